"""oneDNN linear layers (models/layers/linear.py): same results as F.linear, used by the paged model
on CPU in float32 and bfloat16, the dense weights replaced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from opentgi.models.attention.torch_backend import TorchAttentionBackend
from opentgi.models.layers import linear as linear_module
from opentgi.models.layers.kernel_choices import KernelChoiceCache
from opentgi.models.layers.linear import OneDNNLinear, RowTiledLinear, onednn_linear_usable, pack_linears
from opentgi.models.registry import build_paged_model
from tests.helpers.cpu_kernels import (
    cpu_has_onednn_bf16_instructions,
    needs_onednn,
    onednn_param,
    onednn_serves,
    served_linear_class,
)

torch.set_num_threads(1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 40), (16, 40), (300, 40), (2, 3, 40)])
def test_onednn_linear_equals_f_linear(bias, shape):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(72, 40, generator=gen)
    b = torch.randn(72, generator=gen) if bias else None
    x = torch.randn(*shape, generator=gen)
    with torch.inference_mode():
        out = OneDNNLinear(weight, b)(x)
    assert out.shape == (*shape[:-1], 72)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


@needs_onednn(torch.bfloat16)
@pytest.mark.parametrize("shape", [(1, 40), (16, 40), (300, 40)])
def test_onednn_linear_bfloat16_close_to_f_linear(shape):
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(72, 40, generator=gen).bfloat16(), torch.randn(*shape, generator=gen).bfloat16()
    with torch.inference_mode():
        out = OneDNNLinear(weight)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), atol=5e-2, rtol=2e-2)


def test_usable_only_on_cpu_in_float32_and_bfloat16():
    assert not onednn_linear_usable(torch.device("cpu"), torch.float16)
    assert not onednn_linear_usable(torch.device("cuda"), torch.float32)
    assert onednn_linear_usable(torch.device("cpu"), torch.float32)  # torch's CPU wheels ship oneDNN
    # bfloat16: where the CPU has the instructions oneDNN's bfloat16 kernel needs (none on AVX2-only
    # CPUs, which serve bfloat16 through RowTiledLinear)
    has_kernel = cpu_has_onednn_bf16_instructions()
    if has_kernel is not None:
        assert onednn_linear_usable(torch.device("cpu"), torch.bfloat16) == has_kernel


def test_pack_linears_replaces_nested_linears():
    module = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 4, bias=False)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = module(x)
        assert pack_linears(module) == 2
        assert not any(isinstance(m, nn.Linear) for m in module.modules())
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)


def test_paged_llama_on_cpu_float32_uses_onednn(tiny_llama):
    model = build_paged_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), TorchAttentionBackend(),
                              torch.float32, torch.device("cpu"))
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, OneDNNLinear) and isinstance(layer.mlp.down_proj, OneDNNLinear)
    assert model.logits_proj is not None
    hidden = torch.randn(4, model.config.hidden_size)
    expected = F.linear(hidden, model.model.embed_tokens.weight)  # tied embeddings
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-4, rtol=1e-4)
    bf16 = build_paged_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), TorchAttentionBackend(),
                             torch.bfloat16, torch.device("cpu"))
    # oneDNN where this CPU has its bfloat16 kernel, else row-tiled F.linear (batch invariance, the default)
    assert isinstance(bf16.model.layers[0].self_attn.qkv_proj, served_linear_class(torch.bfloat16))
    assert isinstance(bf16.logits_proj, served_linear_class(torch.bfloat16))
    if not onednn_serves(torch.bfloat16):
        hidden = torch.randn(4, model.config.hidden_size).bfloat16()
        torch.testing.assert_close(bf16.compute_logits(hidden).float(),
                                   F.linear(hidden, bf16.model.embed_tokens.weight).float())
    fp16 = build_paged_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), TorchAttentionBackend(),
                             torch.float16, torch.device("cpu"), batch_invariant=False)
    assert isinstance(fp16.model.layers[0].self_attn.qkv_proj, nn.Linear) and fp16.logits_proj is None
    # batch invariance (the default) without a oneDNN kernel: torch's, a measured number of rows a call
    fp16 = build_paged_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), TorchAttentionBackend(),
                             torch.float16, torch.device("cpu"))
    assert isinstance(fp16.model.layers[0].self_attn.qkv_proj, RowTiledLinear)
    assert isinstance(fp16.logits_proj, RowTiledLinear)


def _recording_kernel(monkeypatch) -> list[int]:
    """The row counts oneDNN's linear kernel is called with from now on."""
    real, seen = torch.ops.mkldnn._linear_pointwise, []

    def record(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", record)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, onednn_param(torch.bfloat16)])
def test_fewer_than_four_rows_are_multiplied_as_four(monkeypatch, dtype):
    """oneDNN's kernel was measured faster for 4 rows than for 1 (models/layers/linear.py): 1 to 3
    rows are multiplied as 4, and keep the bits they get inside a product of 4 or 16 rows."""
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(72, 40, generator=gen).to(dtype), torch.randn(16, 40, generator=gen).to(dtype)
    linear = OneDNNLinear(weight)
    seen = _recording_kernel(monkeypatch)
    with torch.inference_mode():
        four, sixteen = linear(x[:4]), linear(x)
        for rows in (1, 2, 3):
            out = linear(x[:rows])
            assert seen[-1] == 4 and out.shape == (rows, 72)
            assert torch.equal(out, four[:rows]) and torch.equal(out, sixteen[:rows])
        assert linear(x[:2].view(1, 2, 40)).shape == (1, 2, 72) and seen[-1] == 4  # rows across leading dims
        linear.min_rows = 1  # the kernel as it is
        linear(x[:1])
        assert seen[-1] == 1


@pytest.mark.parametrize("dtype", [torch.float32, onednn_param(torch.bfloat16)])
def test_the_probe_covers_the_padded_row_count(monkeypatch, dtype):
    """A kernel whose 4-row products differ from other row counts' would make the padded form (and
    the plain one) give a row other bits: the probe multiplies 4 rows too and accepts neither."""
    assert linear_module.find_row_invariant_form(64, 40, dtype) == "padded"
    real = torch.ops.mkldnn._linear_pointwise

    def skewed(x, *args):
        out = real(x, *args)
        return out.add_(0.5) if x.shape[0] == 4 else out

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", skewed)
    assert linear_module.find_row_invariant_form(64, 40, dtype) is None


@pytest.mark.parametrize("dtype", [torch.float32, onednn_param(torch.bfloat16)])
def test_a_form_measured_with_another_padding_is_measured_again(monkeypatch, dtype):
    """The padded row count is part of a measured form's key: an entry kept from a start that
    padded to another count is not reused."""
    forms = KernelChoiceCache()
    monkeypatch.setattr(linear_module, "kernel_choices", forms)
    weight = torch.randn(24, 16).to(dtype)
    forms[(24, 16, dtype, False)] = "plain"  # the key of a start before the padding
    assert OneDNNLinear(weight).make_row_invariant(weight) == "padded"
    assert forms[(24, 16, dtype, False, 4)] == "padded"
