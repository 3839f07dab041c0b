"""Q4_0 and Q4_1 by bfloat16 rows at ~16-bit precision (`passes=2`, the q/k/v and down projections):
where the CPU has AVX-512 BF16, the rows' own values against the blocks (kernels/csrc/blocks_bf16.cpp),
one order of float32 operations on every instruction set; elsewhere the 16-bit activation blocks
that float32 rows take."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import dequantize, quantize

from opentgi.kernels import native
from opentgi.models.loader import cpu_has_bf16

torch.set_num_threads(1)

TYPES = (Q.Q4_0, Q.Q4_1)
COUNTS = (1, 2, 3, 5, 8, 9, 15, 16, 17, 33)


def bf16_kernels() -> bool:
    """Whether this CPU takes the bfloat16 kernels (AVX-512 BF16, the library's AVX-512 variant)."""
    return cpu_has_bf16() and "avx512" in native.supported_isas()


def _weight(qtype: Q, n: int, k: int, seed: int, same: tuple[int, int] | None = None) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if same is not None:  # two columns of one block alike: their values' products cancel exactly
        w[:, same[1]] = w[:, same[0]]
    return quantize(w, qtype)


def _mm(x: torch.Tensor, raw: np.ndarray, qtype: Q, isa: str | None = None) -> torch.Tensor:
    return native.gguf_mm(x, torch.from_numpy(raw), int(qtype), raw.shape[0], isa, passes=2)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: a * b (a bfloat16 value by a small integer) and the sum exact in
    float64 for the magnitudes here (within 2**29 of each other), then rounded once."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _reference(raw: np.ndarray, qtype: Q, x: torch.Tensor) -> np.ndarray:
    """float32 outputs by the kernels' order: per block, four sums from zero, sum j taking pairs
    k = j, j + 4, ... (pair k: values 4 * (k // 2) + k % 2 and that + 2), the pair's second value's
    product first; the block's term d * ((s0 + s1) + (s2 + s3)) (+ m * the values' sum: values i and
    i + 16 added, then folded by halves); the terms added block by block."""
    n, m, k = raw.shape[0], x.shape[0], x.shape[1]
    per = 20 if qtype == Q.Q4_1 else 18
    blocks = raw.reshape(n, k // 32, per)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qtype == Q.Q4_1 else None
    qs = blocks[:, :, per - 16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - (8 if qtype == Q.Q4_0 else 0)
    xv = x.float().numpy()
    out = np.zeros((m, n), np.float32)
    for b in range(k // 32):
        xb = xv[:, 32 * b:32 * b + 32]
        lanes = [xb[:, i] + xb[:, i + 16] for i in range(16)]  # the values' sum: quantize_bf16's tree
        for w in (8, 4, 2, 1):
            lanes = [lanes[i] + lanes[i + w] for i in range(w)]
        total = lanes[0]
        s = [np.zeros((m, n), np.float32) for _ in range(4)]
        for pair in range(16):
            lo = 4 * (pair // 2) + pair % 2
            for v in (lo + 2, lo):
                s[pair % 4] = _fma(xb[:, v][:, None], q[None, :, b, v], s[pair % 4])
        t = d[None, :, b] * ((s[0] + s[1]) + (s[2] + s[3]))
        if mins is not None:
            t = t + mins[None, :, b] * total[:, None]
        out = out + t
    return out


def _cancelling_rows(m: int, k: int, seed: int, cols: tuple[int, int]) -> torch.Tensor:
    """Rows of small values but for +-2**16 at `cols`: against weights alike there, those products
    cancel in the exact sum but leave their float32 rounding, which the order of operations decides
    and the rows' small total leaves visible in bfloat16."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) / 16
    x[:, cols[0]], x[:, cols[1]] = 2.0 ** 16, -(2.0 ** 16)
    return x.bfloat16()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bfloat16_rows_follow_one_order_of_operations_on_every_instruction_set(kernels, qtype):
    cols = (35, 38)  # block 1's values 3 and 6: second values of pairs 1 and 2, in sums 1 and 2
    raw = _weight(qtype, 40, 256, seed=1, same=cols)
    x = _cancelling_rows(9, 256, seed=2, cols=cols)
    if bf16_kernels():
        want = torch.from_numpy(_reference(raw, qtype, x)).bfloat16()
    else:  # the 16-bit activation blocks of the same values
        want = _mm(x.float(), raw, qtype).bfloat16()
    for isa in native.supported_isas():
        got = _mm(x, raw, qtype, isa)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want), (isa, int((got != want).sum()))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_heavy_tailed_bfloat16_rows_keep_their_small_values_where_the_cpu_has_bf16_dots(kernels, qtype):
    """A gated MLP's down input spans orders of magnitude within a block: 16-bit activation blocks,
    rounding each value to 1/32767 of its block's largest, miss the exact product by more than
    float32 rounding. Where the CPU has AVX-512 BF16, the rows' own values meet it (then the
    output's bfloat16 rounding); elsewhere bfloat16 rows take those 16-bit blocks."""
    raw = _weight(qtype, 64, 1024, seed=3)
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float64)).reshape(64, 1024)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(48, 1024, generator=g) * torch.exp(2 * torch.randn(48, 1024, generator=g))).bfloat16()
    exact = x.double() @ w.T
    slack = (1024 / 32 + 16) * 2.0 ** -24 * (x.double().abs() @ w.abs().T)
    low, high = (exact - slack).float().bfloat16().double(), (exact + slack).float().bfloat16().double()

    def within(got: torch.Tensor) -> torch.Tensor:
        return (got.double() >= low) & (got.double() <= high)

    blocks16 = _mm(x.float(), raw, qtype).bfloat16()
    assert not within(blocks16).all()  # the bound sees the 16-bit blocks' error
    got = _mm(x, raw, qtype)
    if bf16_kernels():
        assert within(got).all()
    else:
        assert torch.equal(got, blocks16)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_bfloat16_row_keeps_its_bits_whatever_shares_its_step_and_the_thread_count(kernels, qtype):
    raw = _weight(qtype, 53, 256, seed=5)  # 53 outputs: strips of 16 and single outputs
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            whole = _mm(x, raw, qtype, isa)
            for count in COUNTS:
                for start in range(0, 40 - count + 1, max(count, 7)):
                    assert torch.equal(_mm(x[start:start + count], raw, qtype, isa), whole[start:start + count]), \
                        (isa, count, start)
            for count in range(2, max(2, os.cpu_count() or 1) + 2):
                torch.set_num_threads(count)
                assert torch.equal(_mm(x, raw, qtype, isa), whole), (isa, count)
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


def test_nan_and_inf_in_bfloat16_rows_never_crash(kernels):
    raw = _weight(Q.Q4_1, 24, 128, seed=7)
    x = torch.randn(5, 128).bfloat16()
    x[1, 3], x[2, 40], x[3, 100] = float("nan"), float("inf"), float("-inf")
    for isa in native.supported_isas():
        got = _mm(x, raw, Q.Q4_1, isa)
        assert got.shape == (5, 24)
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[4]).all()
        assert not torch.isfinite(got[1:4]).any()
