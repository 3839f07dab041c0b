"""Batch invariance with LoRA adapters (models/lora/, docs/determinism.md): a projection's rows
keep their bits whatever the step's other rows, their adapters (or none), its row count and a row's
position, in bfloat16 and float32 on 1 and 2 threads; a base row keeps the bits of a step without
adapter rows; through the engine, a request with an adapter gets the same tokens and logprobs alone
and among 16 others with mixed adapters (chunked, speculated, after a prefix-cache hit too), and
`/info` says the server is deterministic."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from opentgi.engine.execution.assembly import batch_invariant
from opentgi.engine.execution.torch_threads import call_in_own_thread
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models import lora
from opentgi.models.layers import adapter_lora
from opentgi.models.layers.kernel_choices import KernelChoiceCache
from tests.helpers import tiny_models
from tests.helpers.cpu_kernels import serve_linears
from tests.helpers.determinism import OTHERS, TARGET, loaded_model
from tests.helpers.engine import running

torch.set_num_threads(1)

# a fused projection of three parts; ranks where a lone bfloat16 row of the stacked form (--nondeterministic)
# took other bits; adapter z adapts nothing here
FAN_IN, OUTS, RANKS = 1536, [64, 32, 32], [64, 128, 128]


def _projection(dtype: torch.dtype) -> tuple[lora.LoraLinear, lora.LoraState]:
    """A fused projection in its row-invariant oneDNN form with the LoRA of adapters x (rank 4) and
    y (rank 8) in their row-invariant form."""
    gen = torch.Generator().manual_seed(0)
    holder = nn.Module()
    holder.proj = nn.Linear(FAN_IN, sum(OUTS), bias=False).to(dtype)
    with torch.no_grad():
        holder.proj.weight.copy_(torch.randn(sum(OUTS), FAN_IN, generator=gen) * FAN_IN ** -0.5)
    serve_linears(holder, dtype)
    a = torch.randn(3, len(OUTS), max(RANKS), FAN_IN, generator=gen) * FAN_IN ** -0.5
    b = [torch.randn(3, max(RANKS), out, generator=gen) * 0.5 for out in OUTS]
    a[0, :, RANKS[0]:] = 0
    for part in b:
        part[0, RANKS[0]:] = 0
    a[2], b[0][2], b[1][2], b[2][2] = 0, 0, 0, 0  # z
    state = lora.LoraState(["x", "y", "z"], max(RANKS), dtype, torch.device("cpu"))
    return lora.LoraLinear(holder.proj, state, a, b, row_invariant=True, ranks=RANKS), state


def _run(layer: lora.LoraLinear, state: lora.LoraState, x: torch.Tensor, adapters: list) -> torch.Tensor:
    state.begin_step(adapters, [1] * len(adapters))
    try:
        return layer(x)
    finally:
        state.end_step()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_bits_do_not_depend_on_the_other_rows_of_its_step(dtype, threads, monkeypatch):
    """Each row with its adapter (x, y, z or none) gets the same bits alone, in every slice of the
    step, in a step of one adapter and in a step of all; a base row gets the bits of a step without
    adapter rows."""
    monkeypatch.setattr(adapter_lora, "kernel_choices", KernelChoiceCache())  # measured at this thread count
    try:
        call_in_own_thread(lambda: _check_row_invariance(dtype), threads)  # as the server runs torch
    finally:
        torch.set_num_threads(1)  # the suite's count, for the threads started after this test


def _check_row_invariance(dtype: torch.dtype) -> None:
    layer, state = _projection(dtype)
    assert layer.adapters[2] is None  # z adapts nothing here: no work for its rows
    x = torch.randn(40, FAN_IN, generator=torch.Generator().manual_seed(3)).to(dtype)
    adapters = [("x", "y", None, "y", "x", "z")[t % 6] for t in range(40)]
    with torch.inference_mode():
        full = _run(layer, state, x, adapters)
        plain = _run(layer, state, x, [None] * 40)
        assert torch.equal(plain, layer.base(x))
        for t in range(12):  # each adapter (and none) at two positions
            assert torch.equal(_run(layer, state, x[t:t + 1], adapters[t:t + 1]), full[t:t + 1]), t
        for count in (2, 7, 16):
            for start in range(0, 40 - count + 1, count):
                assert torch.equal(_run(layer, state, x[start:start + count], adapters[start:start + count]),
                                   full[start:start + count])
        for only in ("x", "y"):
            rows = [t for t, a in enumerate(adapters) if a == only]
            alone = _run(layer, state, x, [a if a == only else None for a in adapters])
            assert torch.equal(alone[rows], full[rows])
            assert torch.equal(_run(layer, state, x[rows], [only] * len(rows)), full[rows])
        base_rows = [t for t, a in enumerate(adapters) if a in (None, "z")]
        assert torch.equal(full[base_rows], plain[base_rows])
        changed = [t for t, a in enumerate(adapters) if a in ("x", "y")]
        assert not torch.allclose(full[changed].float(), plain[changed].float(), atol=1e-2)


def test_the_row_invariant_form_computes_the_per_row_gather():
    """The per-adapter float32 form computes what punica's per-row gather (bgmv_delta) does."""
    base = _projection(torch.float32)[0].base
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(2, len(OUTS), max(RANKS), FAN_IN, generator=gen)
    b = [torch.randn(2, max(RANKS), out, generator=gen) for out in OUTS]
    state = lora.LoraState(["x", "y"], max(RANKS), torch.float32, torch.device("cpu"))
    layer = lora.LoraLinear(base, state, a, b, row_invariant=True)
    x = torch.randn(9, FAN_IN, generator=gen)
    ids = ["y", None, "x", "x", None, "y", "y", "x", None]
    slots = torch.tensor([-1 if i is None else state.slot_of[i] for i in ids])
    expected = base(x) + torch.cat([lora.bgmv_delta(x, a[:, p], b[p], slots) for p in range(len(OUTS))], 1)
    with torch.inference_mode():
        torch.testing.assert_close(_run(layer, state, x, ids), expected, rtol=1e-3, atol=1e-3)


# --- through the engine ------------------------------------------------------------------------------

def _loaded(model_path, dtype: str):  # noqa: F811 - the fixture
    a = tiny_models.tiny_lora_path(model_path, seed=11, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    b = tiny_models.tiny_lora_path(model_path, seed=12, r=8, alpha=4, use_rslora=True,
                                   targets=list(lora.TARGET_MODULES))
    return loaded_model(model_path, dtype, lora_adapters=f"a={a},b={b}")


def _request(ids, adapter, max_new=6) -> GenerationRequest:
    return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=max_new, ignore_eos=True),
                             adapter_id=adapter)


async def _target(loaded, adapter, others=(), position=0, warmup=None, **engine_settings):
    """The target's (tokens, logprobs) with `adapter`, at `position` among `others` (prompt,
    max_new, adapter), after an optional warm-up request with the same adapter (prefix-cache hits)."""
    async with running(loaded, **engine_settings) as engine:
        assert engine.info.deterministic  # /info's `deterministic`, adapters loaded or not
        if warmup is not None:
            await (await engine.submit(_request(warmup, adapter, 1))).result()
        requests = [_request(p, ad, n) for p, n, ad in others]
        requests.insert(position, _request(TARGET, adapter))
        handles = [await engine.submit(r) for r in requests]
        results = await asyncio.gather(*(h.result() for h in handles))
    sequence = results[position].sequences[0]
    return list(sequence.token_ids), [t.logprob for t in sequence.tokens]


MIXED = [(prompt, new, ("a", "b", None)[i % 3]) for i, (prompt, new) in enumerate(OTHERS)]


@pytest.mark.slow  # the ci tier: a long run
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("adapter", ["a", "b", None])
def test_a_request_with_an_adapter_among_16_others_with_mixed_adapters(model_path, dtype, adapter):  # noqa: F811
    """Alone and among 16 others (adapters a, b and none, mixed), at four positions, with chunked
    prefill, with --speculate 4 and after a prefix-cache hit: the same tokens and logprobs; a base request's are those of a
    server without adapters."""
    loaded = _loaded(model_path, dtype)
    assert loaded.model.batch_invariant and batch_invariant(loaded)
    alone = asyncio.run(_target(loaded, adapter))
    assert asyncio.run(_target(loaded, adapter, MIXED, position=7)) == alone
    assert asyncio.run(_target(loaded, adapter, MIXED, position=16, chunked_prefill_tokens=23)) == alone
    assert asyncio.run(_target(loaded, adapter, MIXED, position=5, speculate=4)) == alone
    assert asyncio.run(_target(loaded, adapter, MIXED, position=3, warmup=TARGET[:33] + [77])) == alone
    plain = asyncio.run(_target(loaded_model(model_path, dtype), None))
    assert (alone == plain) == (adapter is None)
