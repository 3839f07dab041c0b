"""Weights repacked by sixteen rows (kernels.native.BY_16_ROWS, kernels/csrc/r16.h): the same bytes
moved. Every block type but Q6_K repacked (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL,
IQ4_XS) takes its type's kernels, the same bits for every row count and thread count; Q6_K_R16 is multiplied by bfloat16 rows
in one order of float32 operations on every instruction set where the CPU has AVX-512 BF16.
models/quantization/gguf_blocks.py repacks those eleven wherever the AVX-512 variant runs (a model's LM
head included) and a bfloat16 model's `passes=2` Q6_K weights where the CPU has AVX-512 BF16, and
nowhere else."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import dequantize
from torch import nn

from opentgi.kernels import native
from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight, repack_by_16_rows
from opentgi.models.quantization.linear import QuantizedLinear
from tests.helpers.gguf_blocks import random_blocks

torch.set_num_threads(1)

ORDER = (0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)  # blocks_bf16.cpp Q6K_ORDER
COUNTS = (1, 2, 3, 5, 8, 9, 15, 16, 17, 33)


def _fields(raw: np.ndarray, block: int) -> np.ndarray:
    """r16.h's layout of every type but Q6_K, from its description: the field at offset o of row c's
    block b (w bytes: 4, or 2 for the float16 d that breaks the words, the first two bytes of a block
    of 2 + 4k bytes or Q3_K's last two) at b * 16 * block + 16 * o + w * c of its group."""
    n, nb = raw.shape[0], raw.shape[1] // block
    d_at = 108 if block == 110 else 0 if block % 4 == 2 else -1
    blocks = raw.reshape(n // 16, 16, nb, block)
    out = np.empty((n // 16, nb, 16 * block), np.uint8)
    o = 0
    while o < block:
        w = 2 if o == d_at else 4
        out[:, :, 16 * o:16 * (o + w)] = blocks[..., o:o + w].transpose(0, 2, 1, 3).reshape(n // 16, nb, 16 * w)
        o += w
    return out.reshape(n, -1)


def _layout(raw: np.ndarray) -> np.ndarray:
    """r16.h's Q6_K layout, written from its description: per group of sixteen rows and superblock
    b, 52 vectors of sixteen 4-byte words (row c's in lane c): scales 4m..4m+3; then per (h, v), ql
    bytes 64h + 16v + 4i, 64h + 32 + 16v + 4i and qh bytes 32h + 16v + 4i (i < 4); then the d's."""
    n, nb = raw.shape[0], raw.shape[1] // 210
    blocks = raw.reshape(n // 16, 16, nb, 210)
    sources = [192 + 4 * m for m in range(4)]
    for h in range(2):
        for v in range(2):
            sources += [64 * h + 16 * v + 4 * i for i in range(4)]
            sources += [64 * h + 32 + 16 * v + 4 * i for i in range(4)]
            sources += [128 + 32 * h + 16 * v + 4 * i for i in range(4)]
    vectors = np.stack([blocks[..., s:s + 4] for s in sources], axis=2)  # [groups, 16 rows, 52, nb, 4]
    vectors = vectors.transpose(0, 3, 2, 1, 4).reshape(n // 16, nb * 52 * 64)
    ds = blocks[..., 208:210].transpose(0, 2, 1, 3).reshape(n // 16, nb * 32)
    return np.concatenate([vectors, ds], axis=1).reshape(n, -1)


def _values(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q - 32 [n, nb, 256] as float32, the int8 scales [n, nb, 16] and d [n, nb] of Q6_K blocks."""
    n, nb = raw.shape[0], raw.shape[1] // 210
    b = raw.reshape(n, nb, 210)
    ql, qh = b[..., :128].astype(np.int32), b[..., 128:192].astype(np.int32)
    q = np.zeros((n, nb, 256), np.int32)
    for h in range(2):
        lo, hi, bits = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        q[..., 128 * h:128 * h + 32] = (lo & 0xF) | ((bits & 3) << 4)
        q[..., 128 * h + 32:128 * h + 64] = (hi & 0xF) | (((bits >> 2) & 3) << 4)
        q[..., 128 * h + 64:128 * h + 96] = (lo >> 4) | (((bits >> 4) & 3) << 4)
        q[..., 128 * h + 96:128 * h + 128] = (hi >> 4) | (((bits >> 6) & 3) << 4)
    scales = b[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return (q - 32).astype(np.float32), scales, d


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: the product exact in float64 (a bfloat16 value by a small integer,
    or a float32 by an int8), the sum too for these magnitudes, then rounded once."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _reference(raw: np.ndarray, x: torch.Tensor) -> np.ndarray:
    """float32 outputs by the kernels' order: per superblock, sub-block j's sum from zero over its
    eight pairs (pair k of its 32-value block: values 4 * (k // 2) + k % 2 and that + 2, the second
    value's product first), T = fma(s_j, sc_j, T) over j in ORDER, then out + d * T."""
    wv, scales, d = _values(raw)
    xv = x.float().numpy()
    m, n = xv.shape[0], raw.shape[0]
    out = np.zeros((m, n), np.float32)
    for b in range(raw.shape[1] // 210):
        t = np.zeros((m, n), np.float32)
        for j in ORDER:
            s = np.zeros((m, n), np.float32)
            for p in range(8):
                k = 8 * (j % 2) + p
                lo = 32 * (j // 2) + 4 * (k // 2) + k % 2
                for v in (lo + 2, lo):
                    s = _fma(xv[:, 256 * b + v][:, None], wv[None, :, b, v], s)
            t = _fma(s, scales[None, :, b, j], t)
        out = out + d[None, :, b] * t
    return out


def _mm(x: torch.Tensor, blocks: torch.Tensor, n: int, isa: str | None = None) -> torch.Tensor:
    return native.gguf_mm(x, blocks, native.Q6_K_R16, n, isa, passes=2)


def _repacked(n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    raw = random_blocks(Q.Q6_K, n, k, seed=seed)
    return raw, native.repack_by_16_rows(torch.from_numpy(raw), Q.Q6_K, k)


REPACKED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.IQ4_NL, Q.IQ4_XS, Q.Q4_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", REPACKED, ids=lambda q: q.name)
def test_the_repack_moves_the_file_bytes_as_its_layout_says_and_back(kernels, qtype):
    raw = random_blocks(qtype, 48, 512, seed=1)
    r16 = native.repack_by_16_rows(torch.from_numpy(raw), qtype, 512)
    assert r16.dtype == torch.uint8 and r16.shape == raw.shape
    block = native.BLOCK_TYPES[int(qtype)][2]
    want = _layout(raw) if qtype == Q.Q6_K else _fields(raw, block)
    assert np.array_equal(r16.numpy(), want)
    assert torch.equal(native.repack_by_16_rows(r16, qtype, 512, back=True), torch.from_numpy(raw))


def test_the_repack_refuses_shapes_and_types_it_cannot_group(kernels):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.repack_by_16_rows(torch.from_numpy(random_blocks(Q.Q6_K, 24, 256)), Q.Q6_K, 256)
    with pytest.raises(RuntimeError, match="rows of 420 bytes"):
        native.repack_by_16_rows(torch.from_numpy(random_blocks(Q.Q6_K, 16, 256)), Q.Q6_K, 512)
    with pytest.raises(RuntimeError, match="is not Q4_0, Q4_1, .* or IQ4_XS"):
        native.repack_by_16_rows(torch.zeros(16, 128, dtype=torch.uint8), 0, 64)  # F32: dense, not blocks


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", REPACKED[:-1], ids=lambda q: q.name)
def test_types_by_16_rows_give_the_file_layouts_bits_on_every_instruction_set(kernels, qtype, passes):
    """Their kernels on the repacked groups: the same integers and float arithmetic as on the file's
    rows, for any row count (one row too, which the file's layout may take eight outputs at a time),
    float32 and bfloat16 rows, and thread count; `passes=2` takes the file layout's form too: 16-bit
    activation blocks for Q4_0, Q4_1 and Q8_0 (Q4_0's and Q4_1's bfloat16 rows by their own values on
    a CPU with AVX-512 BF16), two 8-bit passes for the others."""
    raw = random_blocks(qtype, 64, 512, seed=11)
    blocks = torch.from_numpy(raw)
    r16 = native.repack_by_16_rows(blocks, qtype, 512)
    gen = torch.Generator().manual_seed(12)
    rows = torch.randn(40, 512, generator=gen) * torch.rand(40, 1, generator=gen).mul(4).exp()
    taken = [rows, rows.bfloat16()]
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            for x in taken:
                for count in COUNTS:
                    want = native.gguf_mm(x[:count], blocks, int(qtype), 64, isa, passes=passes)
                    got = native.gguf_mm(x[:count], r16, native.BY_16_ROWS[int(qtype)], 64, isa, passes=passes)
                    assert torch.equal(got, want), (isa, x.dtype, count)
                for count in range(2, max(2, os.cpu_count() or 1) + 2):
                    torch.set_num_threads(count)
                    assert torch.equal(native.gguf_mm(x, r16, native.BY_16_ROWS[int(qtype)], 64, isa, passes=passes),
                                       native.gguf_mm(x, blocks, int(qtype), 64, isa, passes=passes)), (isa, count)
                torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


def _copy_value(raw: np.ndarray, src: int, dst: int, scale_too: bool = False) -> None:
    """Value `dst` of every row's first superblock set to value `src`'s 6-bit q (and, scale_too,
    dst's sub-block scale to src's): the two weights alike, so that equal and opposite rows there
    cancel in the exact sum."""
    b = raw.reshape(raw.shape[0], -1, 210)[:, 0]

    def fields(v: int) -> tuple[int, int, int]:  # ql byte and nibble shift, qh byte and bit shift
        h, r = divmod(v, 128)
        part, low = divmod(r, 32)
        return 64 * h + 32 * (part % 2) + low, 4 * (part // 2), 2 * part, 128 + 32 * h + low

    ql_s, nib_s, bit_s, qh_s = fields(src)
    ql_d, nib_d, bit_d, qh_d = fields(dst)
    low = (b[:, ql_s] >> nib_s) & 0xF
    high = (b[:, qh_s] >> bit_s) & 3
    b[:, ql_d] = (b[:, ql_d] & (0xF0 >> nib_d)) | (low << nib_d)
    b[:, qh_d] = (b[:, qh_d] & ~np.uint8(3 << bit_d)) | (high << bit_d)
    if scale_too:
        b[:, 192 + dst // 16] = b[:, 192 + src // 16]


@pytest.mark.parametrize("cols", [(34, 35), (37, 21)], ids=["pairs", "sub-blocks"])
def test_repacked_q6_k_follows_one_order_of_operations_on_every_instruction_set(kernels, cols):
    """Rows of small values but for +-2**16 at `cols`, whose weights are alike: the big products
    cancel in the exact sum and leave their float32 rounding, which the order decides and the small
    total leaves visible in bfloat16. "pairs": sub-block 2's pairs 0 and 1 (their second values);
    "sub-blocks": sub-blocks 2 and 1, whose places in the superblock's order differ."""
    raw = random_blocks(Q.Q6_K, 48, 512, seed=2)
    _copy_value(raw, cols[0], cols[1], scale_too=True)
    r16 = native.repack_by_16_rows(torch.from_numpy(raw), Q.Q6_K, 512)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3)) / 16
    x[:, cols[0]], x[:, cols[1]] = 2.0 ** 16, -(2.0 ** 16)
    x = x.bfloat16()
    if not native.takes_bf16_rows():  # no AVX-512 BF16: no kernel takes the layout (none is made)
        with pytest.raises(RuntimeError, match="no kernel"):
            _mm(x, r16, 48)
        return
    want = torch.from_numpy(_reference(raw, x)).bfloat16()
    for isa in native.supported_isas():
        got = _mm(x, r16, 48, isa)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want), (isa, int((got != want).sum()))


def test_a_q6_k_row_keeps_its_bits_whatever_shares_its_step_and_the_thread_count(kernels):
    _, r16 = _repacked(64, 256, seed=4)  # four groups: split among threads a group at a time
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    if not native.takes_bf16_rows():
        with pytest.raises(RuntimeError, match="no kernel"):
            _mm(x, r16, 64)
        return
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            whole = _mm(x, r16, 64, isa)
            for count in COUNTS:
                for start in range(0, 40 - count + 1, max(count, 7)):
                    assert torch.equal(_mm(x[start:start + count], r16, 64, isa), whole[start:start + count]), \
                        (isa, count, start)
            for count in range(2, max(2, os.cpu_count() or 1) + 2):
                torch.set_num_threads(count)
                assert torch.equal(_mm(x, r16, 64, isa), whole), (isa, count)
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


def test_repacked_q6_k_meets_the_exact_product_to_float32_rounding(kernels):
    """Heavy-tailed rows (a gated MLP's down input) against float64: the rows' own bfloat16 values
    meet the exact product but for float32 rounding, then the output's bfloat16 rounding."""
    if not native.takes_bf16_rows():
        return
    raw, r16 = _repacked(32, 1024, seed=6)
    w = torch.from_numpy(dequantize(raw, Q.Q6_K).astype(np.float64)).reshape(32, 1024)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(24, 1024, generator=g) * torch.exp(2 * torch.randn(24, 1024, generator=g))).bfloat16()
    exact = x.double() @ w.T
    slack = (1024 / 16 + 32) * 2.0 ** -24 * (x.double().abs() @ w.abs().T)
    low, high = (exact - slack).float().bfloat16().double(), (exact + slack).float().bfloat16().double()
    got = _mm(x, r16, 32).double()
    assert ((got >= low) & (got <= high)).all()


def _linear(raw: np.ndarray, qtype: Q, k: int, passes: int) -> QuantizedLinear:
    linear = QuantizedLinear(k, raw.shape[0])
    linear.weight_format = GGUFBlockWeight(torch.from_numpy(raw), int(qtype), k, passes=passes)
    return linear


def _mapped(raw: np.ndarray, path) -> tuple[np.memmap, torch.Tensor]:
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r").reshape(raw.shape[0], -1)
    with warnings.catch_warnings():  # the map is read-only, as the loader's
        warnings.simplefilter("ignore", UserWarning)
        return mapped, torch.from_numpy(mapped)


def test_a_model_repacks_its_block_weights_and_bfloat16_q6_k_and_keeps_the_file_intact(kernels, tmp_path):
    """Where the AVX-512 variant runs: Q4_K (from the file's memory map: its pages released, the
    file's bytes untouched), Q4_0, Q4_1, Q8_0 and IQ4_XS, one-pass and two-pass, and an expert's
    weights are repacked, with the same outputs; the two-pass Q6_K down only for a bfloat16 model on
    a CPU with AVX-512 BF16. A one-pass Q6_K and a weight of 24 rows keep the file's layout.
    Elsewhere nothing changes."""
    q4k, q6k = random_blocks(Q.Q4_K, 32, 512, seed=8), random_blocks(Q.Q6_K, 32, 512, seed=9)
    mapped, view = _mapped(q4k, tmp_path / "q4k.bin")
    layers = nn.Module()
    layers.gate_proj = _linear(q4k, Q.Q4_K, 512, passes=1)
    layers.gate_proj.weight_format = GGUFBlockWeight(view, int(Q.Q4_K), 512, passes=1, mapped=True)
    layers.down_proj = _linear(q6k, Q.Q6_K, 512, passes=2)
    layers.experts = nn.ModuleList([nn.Module()])
    layers.experts[0].up_proj = _linear(q4k.copy(), Q.Q4_K, 512, passes=1)
    layers.o_proj = _linear(q6k.copy(), Q.Q6_K, 512, passes=1)
    layers.v_proj = _linear(random_blocks(Q.Q4_K, 24, 512, seed=10), Q.Q4_K, 512, passes=2)
    q41 = random_blocks(Q.Q4_1, 32, 512, seed=14)
    layers.up_proj, layers.k_proj = _linear(q41, Q.Q4_1, 512, passes=1), _linear(q41.copy(), Q.Q4_1, 512, passes=2)
    q80 = random_blocks(Q.Q8_0, 32, 512, seed=15)
    layers.q_proj, layers.v_proj2 = _linear(q80, Q.Q8_0, 512, passes=1), _linear(q80.copy(), Q.Q8_0, 512, passes=2)
    q40, iq4 = random_blocks(Q.Q4_0, 32, 512, seed=16), random_blocks(Q.IQ4_XS, 32, 512, seed=17)
    layers.q4_0, layers.q4_0_two = _linear(q40, Q.Q4_0, 512, passes=1), _linear(q40.copy(), Q.Q4_0, 512, passes=2)
    layers.iq4_xs = _linear(iq4, Q.IQ4_XS, 512, passes=2)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(10)).bfloat16()
    compared = (layers.gate_proj, layers.up_proj, layers.k_proj, layers.q_proj, layers.v_proj2, layers.q4_0,
                layers.q4_0_two, layers.iq4_xs)
    before = [m(x) for m in compared]
    avx512 = native.loaded().isa == "avx512"
    repacked = repack_by_16_rows(layers, torch.bfloat16)
    kept = [layers.o_proj, layers.v_proj]
    assert [m.weight_format.qtype for m in kept] == [Q.Q6_K, Q.Q4_K]
    assert layers.experts[0].up_proj.weight_format.qtype == (native.Q4_K_R16 if avx512 else Q.Q4_K)
    gate = layers.gate_proj.weight_format
    assert gate.qtype == (native.Q4_K_R16 if avx512 else Q.Q4_K) and gate.mapped == (not avx512)
    assert all(torch.equal(m(x), b) for m, b in zip(compared, before))
    assert layers.q4_0.weight_format.qtype == (native.Q4_0_R16 if avx512 else Q.Q4_0)
    assert layers.iq4_xs.weight_format.qtype == (native.IQ4_XS_R16 if avx512 else Q.IQ4_XS)
    assert layers.up_proj.weight_format.qtype == (native.Q4_1_R16 if avx512 else Q.Q4_1)
    assert layers.q_proj.weight_format.qtype == (native.Q8_0_R16 if avx512 else Q.Q8_0)
    assert layers.v_proj2.weight_format.qtype == (native.Q8_0_R16 if avx512 else Q.Q8_0)
    assert layers.k_proj.weight_format.qtype == (native.Q4_1_R16 if avx512 else Q.Q4_1)
    assert layers.q4_0_two.weight_format.qtype == (native.Q4_0_R16 if avx512 else Q.Q4_0)
    assert np.array_equal(np.asarray(mapped), q4k) and np.array_equal(np.fromfile(tmp_path / "q4k.bin", np.uint8),
                                                                        q4k.reshape(-1))
    down = layers.down_proj.weight_format
    assert down.qtype == (native.Q6_K_R16 if native.takes_bf16_rows() else Q.Q6_K)
    assert repacked == (2 * (q41.nbytes + q80.nbytes + q40.nbytes + q4k.nbytes) + iq4.nbytes if avx512 else 0) + (
        q6k.nbytes if native.takes_bf16_rows() else 0)
    if native.takes_bf16_rows():
        assert torch.equal(layers.down_proj(x), torch.from_numpy(_reference(q6k, x)).bfloat16())
        assert "Q6_K blocks by 16 rows" in down.description
    if avx512:
        assert "Q4_K blocks by 16 rows" in gate.description


def test_a_float32_model_keeps_its_q6_k_in_the_file_layout(kernels):
    layers = nn.Module()
    layers.down_proj = _linear(random_blocks(Q.Q6_K, 32, 512, seed=13), Q.Q6_K, 512, passes=2)
    assert repack_by_16_rows(layers, torch.float32) == 0
    assert layers.down_proj.weight_format.qtype == Q.Q6_K


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_grouped_experts_by_16_rows_give_the_file_layouts_bits(kernels, qtype):
    """A mixture of experts' grouped gate/up and down calls on repacked experts (gguf_blocks repacks
    routed experts too): each (token, expert) pair's bits are the file layout's, on every ISA."""
    experts, hidden, inter = 4, 256, 256
    up = [torch.from_numpy(random_blocks(qtype, 2 * inter, hidden, seed=20 + e)) for e in range(experts)]
    down = [torch.from_numpy(random_blocks(qtype, hidden, inter, seed=40 + e)) for e in range(experts)]
    up16 = [native.repack_by_16_rows(w, qtype, hidden) for w in up]
    down16 = [native.repack_by_16_rows(w, qtype, inter) for w in down]
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(9, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen)
    r16 = native.BY_16_ROWS[int(qtype)]
    for isa in native.supported_isas():
        for count in (1, 2, 9):
            h = native.moe_up(x[:count], up, int(qtype), ids[:count], 2 * inter, isa=isa, gelu_tanh=False)
            assert torch.equal(native.moe_up(x[:count], up16, r16, ids[:count], 2 * inter, isa=isa, gelu_tanh=False), h)
            want = native.moe_down(h, down, int(qtype), ids[:count], weights[:count], hidden, passes=2, isa=isa)
            got = native.moe_down(h, down16, r16, ids[:count], weights[:count], hidden, passes=2, isa=isa)
            assert torch.equal(got, want), (isa, count)
