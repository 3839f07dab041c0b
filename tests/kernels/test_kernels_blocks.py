"""opentgi::gguf_mm on each block type against a float64 reference (gguf-py's dequantization),
on every instruction-set path this CPU runs.

The error bound is the activations' 8-bit rounding: each input moves by at most half its block's
step (amax / 127 / 2), so an output moves by at most sum_j step_j / 2 * |w_j|; float32 products
and sums add at most 1e-5 of sum_j |x_j w_j| (at most 64 blocks a row here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from opentgi.kernels import native
from tests.helpers.gguf_blocks import F16_FIELDS, TYPES, random_blocks, rows

torch.set_num_threads(1)

K_QUANTS = tuple(q for q in TYPES if native.BLOCK_TYPES[q][1] == 256)  # superblocks of 256: ActQ8K


def reference(raw: np.ndarray, qtype: Q, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T in float64, the bound on a kernel's error for each output)."""
    n = raw.shape[0]
    w = torch.from_numpy(dequantize(raw, qtype)).reshape(n, -1).double()
    xd = x.double()
    block = 256 if qtype in K_QUANTS else 32
    step = xd.view(x.shape[0], -1, block).abs().amax(-1) / 127  # [m, blocks]
    half_steps = step.repeat_interleave(block, dim=1) / 2
    bound = half_steps @ w.abs().T + 1e-5 * (xd.abs() @ w.abs().T) + 1e-30
    return xd @ w.T, bound


def mm(x, raw, qtype, isa):
    return native.gguf_mm(x, torch.from_numpy(raw), int(qtype), raw.shape[0], isa)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("k", [256, 2048])
def test_every_type_is_within_the_activation_rounding_of_the_exact_product(kernels, qtype, k):
    raw = random_blocks(qtype, 48, k, seed=k)
    x = rows(7, k, seed=1)
    want, bound = reference(raw, qtype, x)
    for isa in native.supported_isas():
        got = mm(x, raw, qtype, isa).double()
        assert ((got - want).abs() <= bound).all(), (isa, float(((got - want).abs() / bound).max()))
        assert float((got - want).abs().max()) > 0  # the 8-bit rounding shows: these are the kernel's sums


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bfloat16_rows_give_the_float32_result_rounded(kernels, qtype):
    raw = random_blocks(qtype, 32, 512, seed=3)
    x = rows(3, 512, seed=2).bfloat16()
    got = mm(x, raw, qtype, None)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, mm(x.float(), raw, qtype, None).bfloat16())


def test_the_paths_agree(kernels):
    """Every type adds one exact integer sum a (super)block in order on every path, eight outputs at
    once or one (44 outputs: both): the same bits."""
    isas = native.supported_isas()
    for qtype in TYPES:
        raw = random_blocks(qtype, 44, 1024, seed=5)
        x = rows(5, 1024, seed=6)
        results = [mm(x, raw, qtype, isa) for isa in isas]
        for other in results[1:]:
            assert torch.equal(other, results[0]), qtype.name


# every weight at its type's largest magnitude: (byte range, value) set after the float16 fields
EXTREMES = {Q.Q4_0: ((2, 18, 0xFF),), Q.Q4_1: ((4, 20, 0xFF),), Q.Q8_0: ((2, 34, 0x81),),  # q 15, 15, -127
            Q.Q4_K: ((4, 144, 0xFF),),  # scales and mins 63, q 15
            Q.Q6_K: ((0, 192, 0xFF), (192, 200, 0x80), (200, 208, 0x7F))}  # q - 32 = 31, scales -128, 127


@pytest.mark.parametrize("qtype", tuple(EXTREMES), ids=lambda q: q.name)
def test_largest_weights_against_full_scale_activations_do_not_saturate(kernels, qtype):
    """Twelve outputs (eight at once, four alone; float16 scales of either sign) of the largest
    weights against +-127 activations: within the rounding bound, equal on every path."""
    k = 512
    raw = random_blocks(qtype, 12, k, seed=9).reshape(12, k // native.BLOCK_TYPES[qtype][1], -1)
    for start, end, value in EXTREMES[qtype]:
        raw[..., start:end] = value
    raw = raw.reshape(12, -1)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs: +-127 in every block
    want, bound = reference(raw, qtype, x)
    results = [mm(x, raw, qtype, isa) for isa in native.supported_isas()]
    for got in results:
        assert ((got.double() - want).abs() <= bound).all(), qtype.name
    for other in results[1:]:
        assert torch.equal(other, results[0]), qtype.name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_nan_and_inf_scales_or_inputs_never_crash(kernels, qtype):
    k = 512
    raw = random_blocks(qtype, 16, k, seed=7)
    nan = np.array([np.nan], dtype=np.float16).view(np.uint8)
    bpr = raw.shape[1] // (k // (256 if qtype in K_QUANTS else 32))
    offset = F16_FIELDS[qtype][0]
    raw[3, offset:offset + 2] = nan  # a NaN scale in row 3's first block
    raw[5, offset + bpr:offset + bpr + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    x = rows(4, k, seed=8)
    x[1, 7] = float("nan")
    x[2, 300] = float("inf")
    for isa in native.supported_isas():
        got = mm(x, raw, qtype, isa)
        assert got[:, 3].isnan().all() and got[1].isnan().all() and got[2].isnan().all()
        fine = [c for c in range(16) if c not in (3, 5)]
        assert got[0][fine].isfinite().all() and got[3][fine].isfinite().all()


def test_shapes_the_kernel_cannot_take_are_refused(kernels):
    raw = random_blocks(Q.Q4_K, 4, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        native.gguf_mm(torch.randn(1, 128), torch.from_numpy(raw)[:, :72].contiguous(), int(Q.Q4_K), 4)
    with pytest.raises(RuntimeError, match="rows of 144 bytes"):
        native.gguf_mm(torch.randn(1, 256), torch.from_numpy(raw), int(Q.Q4_K), 5)
