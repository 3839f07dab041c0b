"""Batch invariance by construction: a row's outputs are the same bits alone or among 2..64 other
rows at any position (tiles of four rows start anywhere), and on 1..N threads, on every path."""

from __future__ import annotations

import os

import pytest
import torch

from opentgi.kernels import native
from tests.helpers.gguf_blocks import TYPES, random_blocks, rows

torch.set_num_threads(1)

COUNTS = (1, 2, 3, 4, 5, 7, 16, 17, 64)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_row_gets_the_same_bits_whatever_shares_its_step(kernels, qtype):
    raw = torch.from_numpy(random_blocks(qtype, 72, 512, seed=11))
    x = rows(64, 512, seed=12)
    for isa in native.supported_isas():
        whole = native.gguf_mm(x, raw, int(qtype), 72, isa)
        for count in COUNTS:
            for start in range(0, 64 - count + 1, max(count, 9)):
                part = native.gguf_mm(x[start:start + count], raw, int(qtype), 72, isa)
                assert torch.equal(part, whole[start:start + count]), (isa, count, start)
        shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(0))
        assert torch.equal(native.gguf_mm(x[shuffled], raw, int(qtype), 72, isa), whole[shuffled])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_thread_count_never_changes_a_bit(kernels, qtype):
    raw = torch.from_numpy(random_blocks(qtype, 200, 1024, seed=13))
    x = rows(9, 1024, seed=14)
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            torch.set_num_threads(1)
            one = native.gguf_mm(x, raw, int(qtype), 200, isa)
            for count in range(2, max(2, os.cpu_count() or 1) + 2):  # more threads than cores too
                torch.set_num_threads(count)
                assert torch.equal(native.gguf_mm(x, raw, int(qtype), 200, isa), one), (isa, count)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("passes", [1, 2])
def test_one_or_two_rows_read_in_memory_order_keep_their_bits(kernels, passes):
    """One or two rows read Q6_K weights in memory order, in runs of superblocks (csrc/tiles.h
    in_memory_order8): at K = 18432 (72 superblocks: one run, or for 16-bit activations' byte
    halves a run and a short one) a row alone or in a pair has the bits it has in a tile of four,
    on every path; every other type too."""
    for qtype in TYPES:
        raw = torch.from_numpy(random_blocks(qtype, 12, 18432, seed=15))
        x = rows(6, 18432, seed=16)
        for isa in native.supported_isas():
            whole = native.gguf_mm(x, raw, int(qtype), 12, isa, passes=passes)
            for start, count in ((0, 1), (5, 1), (1, 2), (4, 2)):
                part = native.gguf_mm(x[start:start + count], raw, int(qtype), 12, isa, passes=passes)
                assert torch.equal(part, whole[start:start + count]), (qtype.name, isa, start, count)
