"""opentgi::gguf_mm on Q5_0, Q5_1, Q5_K, Q2_K, Q3_K, IQ4_NL and IQ4_XS (csrc/q5_0_q5_1.cpp,
q5_k.cpp, q2_k_q3_k.cpp, iq4.cpp): against a float64 product of gguf-py's dequantized weights and
the activations' own 8-bit blocks (reproduced here: scale amax / 127, values rounded to nearest
even and clamped), within float32's rounding of the per-block sums (1e-5 of sum |x_q w|); every
path gives the same bits (exact integer sums per block, one float added per block in order), a
row the same bits alone or among others, and the weights' largest values against +-127
activations lose nothing to int16 saturation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from opentgi.kernels import native
from tests.helpers.gguf_blocks import F16_FIELDS, random_blocks, rows

torch.set_num_threads(1)

NEW = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS)


def block_of(qtype: Q) -> int:
    return 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32


def act_q8(x: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel's activations as float64: each block's float32 scale times its int8 values."""
    v = x.float().numpy().reshape(x.shape[0], -1, block)
    amax = np.abs(v).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(v * inv), -127, 127)
    d = (amax / np.float32(127)).astype(np.float32)
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))


def check(raw: np.ndarray, qtype: Q, x: torch.Tensor) -> list[torch.Tensor]:
    """The product on every path, each within float32 rounding of the exact one; returns them."""
    n = raw.shape[0]
    w = torch.from_numpy(dequantize(raw, qtype)).reshape(n, -1).double()
    xq = act_q8(x, block_of(qtype))
    want, bound = xq @ w.T, 1e-5 * (xq.abs() @ w.abs().T) + 1e-30
    results = []
    for isa in native.supported_isas():
        got = native.gguf_mm(x, torch.from_numpy(raw), int(qtype), n, isa)
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (qtype.name, isa, float((err / bound).max()))
        results.append(got)
    return results


@pytest.mark.parametrize("qtype", NEW, ids=lambda q: q.name)
def test_random_blocks_match_the_exact_product_and_every_path_agrees_bitwise(kernels, qtype):
    k = 1024
    raw = random_blocks(qtype, 24, k, seed=int(qtype))
    results = check(raw, qtype, rows(6, k, seed=int(qtype) + 1))
    for other in results[1:]:
        assert torch.equal(other, results[0]), qtype.name


@pytest.mark.parametrize("qtype", (Q.Q5_0, Q.Q5_1), ids=lambda q: q.name)
def test_weights_quantized_by_gguf_py(kernels, qtype):
    gen = np.random.default_rng(3)
    weights = gen.standard_normal((16, 512)).astype(np.float32) * 0.05
    raw = quantize(weights, qtype)
    x = rows(5, 512, seed=4)
    results = check(raw, qtype, x)
    for other in results[1:]:
        assert torch.equal(other, results[0])
    # and near the float weights: 5-bit weights, 8-bit activations
    exact = x.double() @ torch.from_numpy(weights).double().T
    scale = x.double().abs() @ torch.from_numpy(weights).double().abs().T
    assert ((results[0].double() - exact).abs() <= 0.05 * scale).all()


def extreme_blocks(qtype: Q, n: int, k: int) -> np.ndarray:
    """Every weight at its type's largest magnitude (all bits of the values set, or IQ4's -127),
    the largest sub-block scales, float16 scale 1."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros((n, k // block, size), dtype=np.uint8)
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    if qtype in (Q.Q5_0, Q.Q5_1):
        raw[..., 2 * len(F16_FIELDS[qtype]):] = 0xFF  # qh, qs: q = 31
    elif qtype == Q.Q5_K:
        raw[..., 4:] = 0xFF  # scales and mins 63, q = 31
    elif qtype == Q.Q2_K:
        raw[..., :80] = 0xFF  # scales 15 (and mins 15), q = 3
    elif qtype == Q.Q3_K:
        raw[..., 32:96] = 0xFF  # hmask 0 and ql 3: q - 4 = -1 (the test adds ql 0: -4)
        raw[..., 96:108] = 0x00  # scales -32
    elif qtype == Q.IQ4_NL:
        pass  # indices 0: -127
    elif qtype == Q.IQ4_XS:
        raw[..., 4:8] = 0x00  # scales_l 0, scales_h 0: ls - 32 = -32; indices 0: -127
    for start in F16_FIELDS[qtype]:
        raw[..., start:start + 2] = one
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", NEW, ids=lambda q: q.name)
def test_largest_weights_against_full_scale_activations_do_not_saturate(kernels, qtype):
    k = 512
    raw = extreme_blocks(qtype, 24, k)  # 24 outputs: the sixteen- and eight-output forms too
    if qtype == Q.Q3_K:  # also the other extreme: ql = 0 and hmask 0, q - 4 = -4
        raw = np.concatenate([raw, raw.copy()])
        raw.reshape(48, k // 256, 110)[24:, :, 32:96] = 0
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs: +-127 in every block
    x[2, 1::2] = 1.0
    check(raw, qtype, x)


@pytest.mark.parametrize("qtype", NEW, ids=lambda q: q.name)
def test_a_row_gets_the_same_bits_alone_or_among_others(kernels, qtype):
    raw = torch.from_numpy(random_blocks(qtype, 20, 512, seed=21))
    x = rows(11, 512, seed=22)
    for isa in native.supported_isas():
        whole = native.gguf_mm(x, raw, int(qtype), 20, isa)
        for i in (0, 4, 5, 10):
            assert torch.equal(native.gguf_mm(x[i:i + 1], raw, int(qtype), 20, isa), whole[i:i + 1]), (isa, i)
        assert torch.equal(native.gguf_mm(x[3:10], raw, int(qtype), 20, isa), whole[3:10]), isa


@pytest.mark.parametrize("qtype", NEW, ids=lambda q: q.name)
def test_nan_and_inf_in_any_scale_field_never_crash(kernels, qtype):
    k = 512
    raw = random_blocks(qtype, 8, k, seed=31)
    bpr = raw.shape[1] // (k // block_of(qtype))
    for i, start in enumerate(F16_FIELDS[qtype]):
        raw[1 + 2 * i, start:start + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
        raw[2 + 2 * i, bpr + start:bpr + start + 2] = np.array([-np.inf], dtype=np.float16).view(np.uint8)
    x = rows(2, k, seed=32)
    hit = {1 + 2 * i for i in range(len(F16_FIELDS[qtype]))} | {2 + 2 * i for i in range(len(F16_FIELDS[qtype]))}
    results = [native.gguf_mm(x, torch.from_numpy(raw), int(qtype), 8, isa) for isa in native.supported_isas()]
    for got in results:
        assert got[:, 1].isnan().all()  # a NaN scale: the output is NaN, never finite
        assert got[:, [c for c in range(8) if c not in hit]].isfinite().all()
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", (Q.Q5_0, Q.Q5_1, Q.IQ4_NL), ids=lambda q: q.name)
@pytest.mark.parametrize("k", [32, 288, 416])
def test_block_counts_off_avx2s_groups_of_eight(kernels, qtype, k):
    """AVX2 reduces eight 32-value blocks together and the rest one by one: the same bits."""
    raw = random_blocks(qtype, 12, k, seed=k)
    results = check(raw, qtype, rows(5, k, seed=k + 1))
    for other in results[1:]:
        assert torch.equal(other, results[0]), qtype.name
