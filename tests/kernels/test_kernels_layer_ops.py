"""The fused layer ops (kernels/csrc/layer_ops.h: RMSNorm, Gemma's and per-head too; SiLU- and
GELU(tanh)-and-multiply) equal their unfused torch composition within float
rounding (the sum of squares and exp in the kernel's own order), bitwise where the arithmetic is the
same (the residual sum; the norm of a sum), and give a row the same bits alone, among others and on
1..N threads, on every ISA path this CPU has."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from opentgi.kernels import native
from opentgi.models.layers.elementwise import ACTIVATIONS, act_and_mul
from opentgi.models.layers.norm import GemmaRMSNorm, HeadsNorm, RMSNorm, add_and_norm

torch.set_num_threads(1)

SIZES = (8, 13, 64, 576)  # whole vectors and not


def rows(n: int, size: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(n, size, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_torch_norm_and_float64(kernels, dtype):
    for size in SIZES:
        x, w = rows(9, size, 1, dtype), rows(1, size, 2, dtype)[0]
        norm = RMSNorm(size, 1e-6).to(dtype)
        norm.weight.data.copy_(w)
        expected = norm(x)  # the torch composition (norm.native is off)
        x64 = x.double()
        exact = x64 * (x64.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w.double()
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
        for isa in native.supported_isas():
            out = native.rms_norm(x, w, 1e-6, isa)
            assert out.dtype == dtype
            torch.testing.assert_close(out, expected, **tol)
            torch.testing.assert_close(out.double(), exact, **tol)
            total, summed = native.add_rms_norm(x, x.flip(0), w, 1e-6, isa)
            assert torch.equal(summed, x + x.flip(0))  # the residual sum: the same arithmetic
            assert torch.equal(total, native.rms_norm(summed, w, 1e-6, isa))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_silu_times_up(kernels, dtype):
    for size in SIZES:
        gate_up = rows(7, 2 * size, 3, dtype)
        gate, up = gate_up.split(size, dim=-1)
        expected = F.silu(gate) * up
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
        for isa in native.supported_isas():
            out = native.silu_mul(gate_up, isa)
            assert out.shape == (7, size) and out.dtype == dtype
            torch.testing.assert_close(out, expected, **tol)
        assert torch.equal(act_and_mul(gate_up, size, "silu", use_native=True), native.silu_mul(gate_up))
        assert torch.equal(act_and_mul(gate_up.clone(), size, "silu"), ACTIVATIONS["silu"](gate).mul_(up))


def test_a_row_gets_the_same_bits_alone_among_others_and_on_any_thread_count(kernels):
    x, w = rows(64, 576, 4), rows(1, 576, 5)[0]
    gate_up = rows(64, 2 * 1536, 6)
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            norm = native.rms_norm(x, w, 1e-5, isa)
            act = native.silu_mul(gate_up, isa)
            for r in (0, 31, 63):
                assert torch.equal(native.rms_norm(x[r:r + 1], w, 1e-5, isa), norm[r:r + 1])
                assert torch.equal(native.silu_mul(gate_up[r:r + 1], isa), act[r:r + 1])
            for count in range(2, max(2, os.cpu_count() or 1) + 2):
                torch.set_num_threads(count)
                assert torch.equal(native.rms_norm(x, w, 1e-5, isa), norm)
                assert torch.equal(native.silu_mul(gate_up, isa), act)
            torch.set_num_threads(1)
    finally:
        torch.set_num_threads(threads)


def test_the_norm_module_serves_natively_only_when_told(kernels):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.copy_(rows(1, 64, 7)[0])
    x, residual = rows(3, 64, 8), rows(3, 64, 9)
    torch_out, torch_sum = add_and_norm(norm, x.clone(), residual)
    norm.native = True
    out, summed = add_and_norm(norm, x.clone(), residual)
    assert torch.equal(summed, torch_sum) and torch.equal(out, native.rms_norm(summed, norm.weight, 1e-6))
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(norm(x), native.rms_norm(x, norm.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_gelu_times_up(kernels, dtype):
    for size in SIZES:
        gate_up = rows(7, 2 * size, 10, dtype)
        gate, up = gate_up.split(size, dim=-1)
        expected = F.gelu(gate, approximate="tanh") * up
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
        for isa in native.supported_isas():
            out = native.gelu_tanh_mul(gate_up, isa)
            assert out.shape == (7, size) and out.dtype == dtype
            torch.testing.assert_close(out, expected, **tol)
            for r in (0, 6):  # a row alone: its own bits
                assert torch.equal(native.gelu_tanh_mul(gate_up[r:r + 1], isa), out[r:r + 1])
        assert torch.equal(act_and_mul(gate_up, size, "gelu_pytorch_tanh", use_native=True),
                           native.gelu_tanh_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_and_per_head_norms_serve_natively_as_their_torch_forms(kernels, dtype):
    """Gemma's (1 + w) weight applied in float32 (rounded once), and q's and k's per-head weights
    ([heads, D]: row r takes weight r % heads), within float rounding of the torch forms."""
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    gemma = GemmaRMSNorm(64, 1e-6).to(dtype)
    gemma.weight.data.copy_(rows(1, 64, 11)[0] * 0.3)
    x = rows(5, 64, 12, dtype)
    expected = gemma(x)
    gemma.native = True
    out = gemma(x)
    assert torch.equal(out, native.rms_norm(x, gemma.weight.float() + 1, 1e-6))
    torch.testing.assert_close(out, expected, **tol)
    for kind in (RMSNorm, GemmaRMSNorm):
        q_norm, k_norm = kind(16, 1e-6).to(dtype), kind(16, 1e-6).to(dtype)
        q_norm.weight.data.copy_(rows(1, 16, 13)[0])
        k_norm.weight.data.copy_(rows(1, 16, 14)[0])
        heads = HeadsNorm(q_norm, k_norm, 4, 2)
        qk = rows(3 * 6, 16, 15, dtype).view(3, 6, 16)
        expected = heads(qk)
        heads.native = True
        out = heads(qk)
        torch.testing.assert_close(out, expected, **tol)
        assert torch.equal(out[:, :4], native.rms_norm(qk[:, :4], heads.weight[0], 1e-6))
        assert torch.equal(out[:, 4:], native.rms_norm(qk[:, 4:], heads.weight[4], 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_apply_rotary_bit_for_bit(kernels, dtype):
    """The decode stack's RoPE (layer_ops.h rope_row): the torch composition's products rounded to the
    dtype, then their sum, on every ISA; head sizes whose halves fill vectors (64, 128) and not (40)."""
    from opentgi.models.layers.rotary import apply_rotary

    for d in (40, 64, 128):
        x = rows(7 * 3, d, 3, dtype).view(7, 3, d)
        angles = torch.rand(7, d // 2, generator=torch.Generator().manual_seed(4)) * 6
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
        sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)  # signed: the first half negated
        expected = apply_rotary(x, cos[:, None, :], sin[:, None, :])
        for isa in native.supported_isas():
            assert torch.equal(native.rope(x, cos, sin, isa), expected), (d, isa)


def test_argmax_rows_is_numpys_argmax_of_the_rounded_row(kernels):
    g = torch.Generator().manual_seed(7)
    for size in (1, 7, 8, 13, 64, 577):
        x = torch.randn(12, size, generator=g)
        x[1] = 2.5  # every value the largest: the first
        x[2] = float("-inf")
        x[3, size // 2:] = x[3].max() + 1  # ties from the middle on, in the vectors and the tail
        x[4, -1] = float("inf")
        x[5, size // 3] = float("nan")  # the first NaN wins, wherever it lies
        x[5, -1] = float("nan")
        x[6, -1] = float("nan")
        x[7, 0] = 1e30  # the largest first
        x[8] = x[8].max() - x[8] * 1e-5  # distinct in float32, ties once rounded to bfloat16
        x[9, :] = float("nan")
        for n in {size, max(1, size - 3)}:
            for bf16 in (False, True):
                seen = (x.to(torch.bfloat16).float() if bf16 else x)[:, :n].numpy()
                expected = seen.argmax(axis=-1).tolist()
                for isa in native.supported_isas():
                    assert native.argmax_rows(x, n, bf16, isa).tolist() == expected, (size, n, bf16, isa)
    with pytest.raises(RuntimeError, match="1 <= n <= N"):
        native.argmax_rows(torch.zeros(2, 4), 5, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vector_variants_give_the_same_bits(kernels, dtype):
    """AVX-512's row ops (sixteen values a step, then AVX2's eight) compute each value with AVX2's
    instructions: the same bits, on rows of whole vectors and not (every vector variant this CPU
    runs against AVX2's; the scalar one computes exp and the sum of squares its own way)."""
    vector = [isa for isa in native.supported_isas() if isa != "scalar"]
    assert vector[0] == "avx2" or not vector
    for size in (8, 24, 40, 576, 1544):
        x, y, w = rows(5, size, 21, dtype), rows(5, size, 22, dtype), rows(1, size, 23, dtype)[0]
        gate_up = rows(5, 2 * size, 24, dtype) * 4  # exp's range ends too
        outs = {isa: (native.rms_norm(x, w, 1e-6, isa), native.rms_norm(x, w.float() + 1, 1e-6, isa),
                      *native.add_rms_norm(x, y, w, 1e-6, isa), native.silu_mul(gate_up, isa),
                      native.gelu_tanh_mul(gate_up, isa)) for isa in vector}
        for isa in vector[1:]:
            for got, want in zip(outs[isa], outs[vector[0]], strict=True):
                assert torch.equal(got, want), (size, isa)
