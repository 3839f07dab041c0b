"""The automatic dtype (models/loader.py): bfloat16 on CUDA and on CPUs with native bfloat16
(avx512_bf16 / AMX), float32 elsewhere, --dtype overriding; bfloat16's greedy tokens against
float32's on the real default model."""

from __future__ import annotations

import pytest
import torch

from opentgi.config import Settings
from opentgi.models import loader
from opentgi.models.loader import cpu_has_bf16  # the real one (conftest pins loader's to False)

CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\n"


@pytest.mark.parametrize(("extra", "expected"), [("avx512_bf16", True), ("amx_bf16 amx_tile", True),
                                                 ("avx512_vnni", False), ("", False)])
def test_cpu_has_bf16_reads_the_flags(extra, expected):
    assert cpu_has_bf16(CPUINFO.format(extra=extra)) is expected
    assert cpu_has_bf16("processor\t: 0\n") is False  # no flags line


@pytest.mark.parametrize("has_bf16", [True, False])
def test_default_dtype_follows_the_cpu_and_dtype_overrides(monkeypatch, has_bf16):
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda cpuinfo=None: has_bf16)
    cpu = torch.device("cpu")
    assert loader.resolve_dtype(Settings(), cpu) == (torch.bfloat16 if has_bf16 else torch.float32)
    assert loader.resolve_dtype(Settings(), torch.device("cuda")) == torch.bfloat16
    assert loader.resolve_dtype(Settings(dtype="float32"), cpu) == torch.float32
    assert loader.resolve_dtype(Settings(dtype="bf16"), cpu) == torch.bfloat16


def test_the_default_model_loads_in_bfloat16_on_a_bf16_cpu(monkeypatch, tiny_llama):
    from tests.helpers.cpu_kernels import served_linear_class

    monkeypatch.setattr(loader, "cpu_has_bf16", lambda cpuinfo=None: True)
    loaded = loader.load_model(Settings(model_id=str(tiny_llama)))
    assert loaded.spec.dtype == torch.bfloat16
    # oneDNN's linear where this CPU has its bfloat16 kernel (a bf16 CPU does), else row-tiled F.linear
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, served_linear_class(torch.bfloat16))


# Where float32's two best tokens are closer than this (in logits), bfloat16 may pick the other one.
NEAR_TIE = 0.25


@pytest.mark.slow
def test_default_model_bfloat16_greedy_agrees_with_float32_except_near_ties(default_model):
    """Teacher-forced on float32's greedy continuation of each prompt: bfloat16's greedy token is
    float32's at every position where float32's top-two margin is at least NEAR_TIE. Measured:
    4 near-tie flips in 192 positions (margins 0.03-0.17), after which the free-running texts part."""
    from tests.helpers.paged import PagedRunner

    m32, m16 = default_model(dtype="float32"), default_model(dtype="bfloat16")
    assert m16.spec.dtype == torch.bfloat16
    tok = m32.tokenizer
    checked = flips = 0
    for text in ("Name three colours of the rainbow.", "What is 2+2?",
                 "Write a Python function that reverses a string.", "Tell me about Paris."):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        r32, r16 = PagedRunner(m32.model), PagedRunner(m16.model)
        l32, l16 = m32.model.compute_logits(r32.step({0: ids})), m16.model.compute_logits(r16.step({0: ids}))
        for _ in range(48):
            token = int(l32.argmax())
            best, second = l32[0].topk(2).values.tolist()
            if best - second >= NEAR_TIE:
                checked += 1
                assert int(l16.argmax()) == token, (text, tok.decode([token]))
            else:
                flips += int(l16.argmax()) != token
            l32 = m32.model.compute_logits(r32.step({0: [token]}))
            l16 = m16.model.compute_logits(r16.step({0: [token]}))
    assert checked >= 150 and flips <= 10
