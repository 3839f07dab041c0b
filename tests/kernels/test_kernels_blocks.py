"""opentgi::gguf_mm on each block type against a float64 reference (gguf-py's dequantization),
on every instruction-set path this CPU runs.

The error bound is the activations' 8-bit rounding: each input moves by at most half its block's
step (amax / 127 / 2), so an output moves by at most sum_j step_j / 2 * |w_j|; float32 products
and sums add at most 1e-5 of sum_j |x_j w_j| (at most 64 blocks a row here). With `passes=2` the
step is 16-bit activations' (amax / 32767 for blocks of 32, amax / 16383 for superblocks: the
wide kernels of Q4_0, Q4_1, Q8_0, Q4_K and Q6_K) or two 8-bit passes' (amax / 127 / 254: the rest)."""

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
WIDE = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)  # 16-bit activations where `passes=2` asks


def steps(qtype: Q, passes: int) -> float:
    """The activations' quantization steps a block's amax, for `passes`."""
    if passes == 1:
        return 127
    if qtype in WIDE:
        return 16383 if qtype in K_QUANTS else 32767
    return 127 * 254


def reference(raw: np.ndarray, qtype: Q, x: torch.Tensor, passes: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T in float64, the bound on a kernel's error for each output)."""
    n = raw.shape[0]
    w = torch.from_numpy(dequantize(raw, qtype)).reshape(n, -1).double()
    xd = x.double()
    block = 256 if qtype in K_QUANTS else 32
    step = xd.view(x.shape[0], -1, block).abs().amax(-1) / steps(qtype, passes)  # [m, blocks]
    half_steps = step.repeat_interleave(block, dim=1) / 2
    bound = half_steps @ w.abs().T + 1e-5 * (xd.abs() @ w.abs().T) + 1e-30
    return xd @ w.T, bound


def mm(x, raw, qtype, isa, passes=1):
    return native.gguf_mm(x, torch.from_numpy(raw), int(qtype), raw.shape[0], isa, passes=passes)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("k", [256, 2048])
def test_every_type_is_within_the_activation_rounding_of_the_exact_product(kernels, qtype, k):
    raw = random_blocks(qtype, 48, k, seed=k)
    x = rows(7, k, seed=1)
    for passes in (1, 2):
        want, bound = reference(raw, qtype, x, passes)
        for isa in native.supported_isas():
            got = mm(x, raw, qtype, isa, passes).double()
            assert ((got - want).abs() <= bound).all(), (isa, passes, float(((got - want).abs() / bound).max()))
            assert float((got - want).abs().max()) > 0  # the rounding shows: these are the kernel's sums


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bfloat16_rows_give_the_float32_result_rounded(kernels, qtype):
    raw = random_blocks(qtype, 32, 512, seed=3)
    x = rows(3, 512, seed=2).bfloat16()
    got = mm(x, raw, qtype, None)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, mm(x.float(), raw, qtype, None).bfloat16())


def test_the_paths_agree(kernels):
    """Every type adds one exact integer sum a (super)block in order on every path, sixteen or eight
    outputs at once or one (44 outputs: each), against 8-bit activations and (passes=2) 16-bit ones or two
    8-bit passes: the same bits, and a row's bits whatever the tile of rows it is computed in (11
    rows: a tile of eight and three; a row alone)."""
    isas = native.supported_isas()
    for qtype in TYPES:
        raw = random_blocks(qtype, 44, 1024, seed=5)
        x = rows(11, 1024, seed=6)
        for passes in (1, 2):
            results = [mm(x, raw, qtype, isa, passes) for isa in isas]
            for other in results[1:]:
                assert torch.equal(other, results[0]), (qtype.name, passes)
            assert torch.equal(mm(x[9:10], raw, qtype, isas[-1], passes), results[0][9:10]), (qtype.name, passes)


def test_wide_rows_in_l2_sized_blocks_keep_their_bits(kernels):
    """Wide activations at K=4096 come in blocks of 8-16 rows (csrc/tiles.h drive): 21 rows give a
    short last block; every row has its bits alone and on every path."""
    isas = native.supported_isas()
    for qtype in WIDE:
        raw = random_blocks(qtype, 28, 4096, seed=11)
        x = rows(21, 4096, seed=12)
        results = [mm(x, raw, qtype, isa, 2) for isa in isas]
        for other in results[1:]:
            assert torch.equal(other, results[0]), qtype.name
        for i in (0, 9, 17, 20):
            assert torch.equal(mm(x[i:i + 1], raw, qtype, isas[-1], 2), results[0][i:i + 1]), (qtype.name, i)


# every weight at its type's largest magnitude: (byte range, value) set after the float16 fields
EXTREMES = {Q.Q4_0: ((2, 18, 0xFF),), Q.Q4_1: ((4, 20, 0xFF),), Q.Q8_0: ((2, 34, 0x81),),  # q 15, 15, -127
            Q.Q4_K: ((4, 144, 0xFF),),  # scales and mins 63, q 15
            Q.Q6_K: ((0, 192, 0xFF), (192, 200, 0x80), (200, 208, 0x7F))}  # q - 32 = 31, scales -128, 127
# and Q6_K's largest product, (q - 32) * sc = -32 * -128: 32 of them against 16383 fill an int32 lane
CASES = [(qtype, fills) for qtype, fills in EXTREMES.items()] + [(Q.Q6_K, ((0, 192, 0x00), (192, 208, 0x80)))]


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize(("qtype", "fills"), CASES, ids=[f"{q.name}-{i}" for i, (q, _) in enumerate(CASES)])
def test_largest_weights_against_full_scale_activations_do_not_saturate(kernels, qtype, fills, passes):
    """28 outputs (sixteen at once, eight, four alone; float16 scales of either sign) of the largest
    weights against full-scale activations (+-127; +-16383 or +-32767 wide, where Q6_K's int32
    lanes have the least room): within the rounding bound, equal on every path and row by row."""
    k = 512
    raw = random_blocks(qtype, 28, k, seed=9).reshape(28, k // native.BLOCK_TYPES[qtype][1], -1)
    for start, end, value in fills:
        raw[..., start:end] = value
    raw = raw.reshape(28, -1)
    x = torch.ones(6, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs: +-127 in every block
    x[3, 1::2] = -1.0  # (six rows: every many-row form)
    x[4, ::4] = -1.0
    x[5, 2::4] = -1.0
    want, bound = reference(raw, qtype, x, passes)
    results = [mm(x, raw, qtype, isa, passes) for isa in native.supported_isas()]
    for got in results:
        assert ((got.double() - want).abs() <= bound).all(), qtype.name
    for other in results[1:]:
        assert torch.equal(other, results[0]), qtype.name
    for i in range(6):  # a row alone (the wide kernels' one-row form)
        assert torch.equal(mm(x[i:i + 1], raw, qtype, None, passes), results[0][i:i + 1]), qtype.name


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


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_activation_blocks_come_out_alike_on_every_instruction_set_at_their_edges(kernels, qtype, passes):
    """The rows' quantization (8-bit blocks, or superblocks for Q4_K; at passes=2 16-bit ones, or
    bfloat16 blocks for bfloat16 rows where the CPU takes them) gives every ISA the same bits for
    blocks of zeros, with a NaN, an Inf or a subnormal, near float32's top, and of products halfway
    between integers (rounded to even), in float32 and bfloat16 rows."""
    k = 1024
    raw = random_blocks(qtype, 32, k, seed=21)
    x = rows(6, k, seed=22)
    x[0, :256] = 0
    x[1, 37] = float("nan")
    x[2, 70] = float("inf")
    x[3, 96:128] = 1e-3
    x[3, 100] = 1e-40
    x[4, 200:232] = 1e38
    x[5, 64:96] = torch.tensor([127.0] + [i + 0.5 for i in range(-15, 16)])  # amax 127: the products as they are
    for row_dtype in (torch.float32, torch.bfloat16):
        xx = x.to(row_dtype)
        got = [mm(xx, raw, qtype, isa, passes) for isa in native.supported_isas()]
        bits = torch.int32 if got[0].dtype == torch.float32 else torch.int16
        for other in got[1:]:
            assert torch.equal(other.view(bits), got[0].view(bits)), (row_dtype, passes)
        assert not got[0][[1, 2]].isfinite().any() and got[0][[0, 3, 5]].isfinite().all()


def test_shapes_the_kernel_cannot_take_are_refused(kernels):
    raw = random_blocks(Q.Q4_K, 4, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        native.gguf_mm(torch.randn(1, 128), torch.from_numpy(raw)[:, :72].contiguous(), int(Q.Q4_K), 4)
    with pytest.raises(RuntimeError, match="rows of 144 bytes"):
        native.gguf_mm(torch.randn(1, 256), torch.from_numpy(raw), int(Q.Q4_K), 5)
