"""Paged decode attention (`opentgi::paged_attention`, kernels/csrc/attention.h) and the native
attention backend: against a float64 reference and the torch backend over fragmented block tables,
shared prefix blocks, windows and soft-caps; bitwise the same for a row alone, among others, with
padded tables and on 1..N threads, on every ISA path this CPU has."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentgi.kernels import native
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.native_backend import NativeAttentionBackend
from opentgi.models.attention.selector import select_backend
from opentgi.models.attention.torch_backend import TorchAttentionBackend
from tests.helpers.hypothesis_profiles import examples

torch.set_num_threads(1)

BLOCK = 16


def cache_and_tables(lens: list[int], kv_heads: int, dim: int, seed: int, shared: int = 0, dtype=torch.float32):
    """Random caches and block tables: blocks scattered over the pool (fragmented), the first
    `shared` blocks of every table the same ones (a shared prefix), each table padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    pool = shared + sum(max(0, n - shared) for n in need) + 3
    order = torch.randperm(pool, generator=gen).tolist()
    prefix, rest = order[:shared], order[shared:]
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        own = [rest.pop() for _ in range(max(0, n - shared))]
        tables[i, :n] = torch.tensor((prefix + own)[:n], dtype=torch.int32)
    k_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    return k_cache, v_cache, tables


def reference(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
    """float64 attention of row i's query over the first lens[i] positions of table i."""
    kv_heads, dim = k_cache.shape[2:]
    group = q.shape[1] // kv_heads
    outs = []
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i].long()[pos // BLOCK] * BLOCK + pos % BLOCK
        keys = k_cache.view(-1, kv_heads, dim)[slots].double().repeat_interleave(group, 1)
        values = v_cache.view(-1, kv_heads, dim)[slots].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[i].double(), keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if window is not None:
            s[:, pos <= n - 1 - window] = -math.inf
        outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), values))
    return torch.stack(outs)


def decode_meta(lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """A decode step (one new token a row, already in the cache: slots -1) over these tables."""
    rows = len(lens)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.full((rows,), -1, dtype=torch.long),
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
        cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0).to(torch.int32)]),
        max_seqlen_q=1, max_seqlen_k=max(lens), context_lens=ctx, block_tables=tables, decode_only=True)


def run(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None, isa=None):
    seq = torch.arange(len(lens), dtype=torch.int32)
    return native.paged_attention(q, k_cache, v_cache, tables, seq, torch.tensor(lens, dtype=torch.int32),
                                  scale, window, softcap, isa)


@settings(max_examples=examples(30))
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=5), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3, 4]), dim=st.sampled_from([8, 20, 64]), shared=st.integers(0, 2),
       window=st.one_of(st.none(), st.integers(1, 40)), softcap=st.one_of(st.none(), st.sampled_from([5.0, 30.0])),
       seed=st.integers(0, 2**16))
def test_matches_float64_and_the_torch_backend(kernels, lens, kv_heads, group, dim, shared, window, softcap, seed):
    lens = [max(n, shared * BLOCK) for n in lens]  # a shared prefix is whole blocks of each row
    k_cache, v_cache, tables = cache_and_tables(lens, kv_heads, dim, seed, shared)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 1))
    scale = dim ** -0.5
    expected = reference(q, k_cache, v_cache, tables, lens, scale, window, softcap)
    for isa in native.supported_isas():
        out = run(q, k_cache, v_cache, tables, lens, scale, window, softcap, isa)
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    # behind the backend interface: decode rows as the torch backend attends them
    meta, empty = decode_meta(lens, tables), torch.zeros(len(lens), kv_heads, dim)
    extra = {"softcap": softcap} if softcap is not None else {}
    ours = NativeAttentionBackend().forward(q, empty, empty, k_cache, v_cache, meta, scale, window, **extra)
    theirs = TorchAttentionBackend().forward(q, empty, empty, k_cache, v_cache, decode_meta(lens, tables), scale,
                                             window, **extra)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


def test_a_row_gets_the_same_bits_alone_among_others_padded_and_on_any_thread_count(kernels):
    lens = [1 + (37 * i) % 150 for i in range(64)]
    k_cache, v_cache, tables = cache_and_tables(lens, 2, 64, seed=3, shared=0)
    q = torch.randn(64, 6, 64, generator=torch.Generator().manual_seed(4))
    ctx = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            for window, softcap in ((None, None), (50, 20.0)):
                whole = run(q, k_cache, v_cache, tables, lens, 0.125, window, softcap, isa)
                for r in (0, 17, 63):  # alone, its table the only one and padded wider
                    wide = torch.full((1, tables.shape[1] + 5), -1, dtype=torch.int32)
                    wide[0, :tables.shape[1]] = tables[r]
                    alone = run(q[r:r + 1], k_cache, v_cache, wide, lens[r:r + 1], 0.125, window, softcap, isa)
                    assert torch.equal(alone, whole[r:r + 1]), (isa, r)
                perm = torch.randperm(64, generator=torch.Generator().manual_seed(5))
                shuffled = native.paged_attention(q[perm], k_cache, v_cache, tables, perm.to(torch.int32), ctx[perm],
                                                  0.125, window, softcap, isa)
                assert torch.equal(shuffled, whole[perm]), isa
                for count in range(2, max(2, os.cpu_count() or 1) + 2):  # more threads than cores too
                    torch.set_num_threads(count)
                    assert torch.equal(run(q, k_cache, v_cache, tables, lens, 0.125, window, softcap, isa), whole)
                torch.set_num_threads(1)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_caches_and_bfloat16_queries(kernels, cache_dtype):
    lens = [3, 40, 65]
    k_cache, v_cache, tables = cache_and_tables(lens, 2, 32, seed=6, dtype=cache_dtype)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(7))
    for isa in native.supported_isas():
        out = run(q, k_cache, v_cache, tables, lens, 0.2, isa=isa)  # read as their exact float32 values
        assert torch.equal(out, run(q, k_cache.float(), v_cache.float(), tables, lens, 0.2, isa=isa))
        low = run(q.bfloat16(), k_cache, v_cache, tables, lens, 0.2, isa=isa)
        assert low.dtype == torch.bfloat16
        expected = reference(q.bfloat16(), k_cache, v_cache, tables, lens, 0.2)
        torch.testing.assert_close(low.double(), expected, atol=2e-2, rtol=2e-2)


def test_generated_tokens_of_a_longer_row_get_their_decode_bits(kernels):
    """Batch invariance: a row of several generated tokens (a recomputed or verify row) attends each
    token as the decode row of its position would, in one call with the step's decode rows."""
    k_cache, v_cache, tables = cache_and_tables([48, 30], 2, 16, seed=8)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(4, 4, 16, generator=gen)  # 3 tokens of sequence 0 (positions 45..47), 1 of sequence 1
    backend = NativeAttentionBackend()
    backend.batch_invariant = True
    empty = torch.zeros(4, 2, 16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((4,), -1, dtype=torch.long), cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 48, 78], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=48,
        context_lens=torch.tensor([48, 30], dtype=torch.int32), block_tables=tables, decode_only=False)
    out = backend.forward(q, empty, empty, k_cache, v_cache, meta, 0.25)
    for row, (seq, ctx) in enumerate(((0, 46), (0, 47), (0, 48), (1, 30))):
        alone = backend.forward(q[row:row + 1], empty[:1], empty[:1], k_cache, v_cache,
                                decode_meta([ctx], tables[seq:seq + 1]), 0.25)
        assert torch.equal(out[row:row + 1], alone), row


def test_bad_tables_are_refused_with_a_clear_error(kernels):
    k_cache, v_cache, tables = cache_and_tables([20], 1, 8, seed=10)
    q = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="has 200 keys"):
        run(q, k_cache, v_cache, tables, [200], 1.0)  # more keys than the table holds
    tables[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="reads block"):
        run(q, k_cache, v_cache, tables, [20], 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        run(torch.randn(1, 3, 8), torch.randn(4, BLOCK, 2, 8), torch.randn(4, BLOCK, 2, 8), tables, [5], 1.0)


def test_the_selector_follows_kernels(kernels):
    cpu = torch.device("cpu")
    assert select_backend(cpu, torch.float32, "native").name == "native"
    assert select_backend(cpu, torch.float32, "auto").name == "native"
    assert select_backend(cpu, torch.float32, "torch").name == "torch"


def test_float16_queries_take_the_torch_forms(kernels):
    lens = [5, 33]
    k_cache, v_cache, tables = cache_and_tables(lens, 2, 16, seed=11, dtype=torch.float16)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(12)).half()
    empty = torch.zeros(2, 2, 16, dtype=torch.float16)
    ours = NativeAttentionBackend().forward(q, empty, empty, k_cache, v_cache, decode_meta(lens, tables), 0.25)
    theirs = TorchAttentionBackend().forward(q, empty, empty, k_cache, v_cache, decode_meta(lens, tables), 0.25)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("prompt_form", [False, True])
def test_float16_caches_native_and_torch_backends_agree(kernels, prompt_form):
    """--kv-cache-dtype float16 under float32 queries, one step that writes its keys: sequence 0's 20
    prompt tokens after 12 cached, sequence 1's decode row. Both backends store the same float16
    keys; the native one attends them as a float32 cache of the same values (bitwise) and as the
    torch backend (within float32 rounding)."""
    lens = [32, 40]
    *caches, tables = cache_and_tables(lens, 2, 32, seed=13, dtype=torch.float16)
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(21, 6, 32, generator=gen)
    k, v = torch.randn(21, 2, 32, generator=gen), torch.randn(21, 2, 32, generator=gen)
    positions = list(range(12, 32)) + [39]
    slots = torch.tensor([int(tables[0 if i < 20 else 1, p // BLOCK]) * BLOCK + p % BLOCK
                          for i, p in enumerate(positions)])

    def step(backend, k_cache, v_cache, k=k, v=v):
        backend.batch_invariant, backend.prompt_form = True, prompt_form
        meta = AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=torch.tensor([0, 20, 21], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 32, 72], dtype=torch.int32), max_seqlen_q=20, max_seqlen_k=40,
            context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, decode_only=False,
            prompt_new_tokens=[20, 0])
        return backend.forward(q, k, v, k_cache, v_cache, meta, 32 ** -0.5)

    native_caches = [c.clone() for c in caches]
    ours = step(NativeAttentionBackend(), *native_caches)
    torch_caches = [c.clone() for c in caches]
    theirs = step(TorchAttentionBackend(), *torch_caches)
    assert native_caches[0].dtype == torch.float16
    assert all(torch.equal(a, b) for a, b in zip(native_caches, torch_caches, strict=True))
    assert torch.equal(native_caches[0].view(-1, 2, 32)[slots], k.half())  # rounded to nearest even
    torch.testing.assert_close(ours, theirs, atol=3e-6, rtol=1e-5)
    as_float32 = [c.float() for c in caches]  # the same values in a float32 cache, given the rounded keys
    assert torch.equal(step(NativeAttentionBackend(), *as_float32, k=k.half().float(), v=v.half().float()), ours)


def test_long_rows_in_splits_match_float64_and_keep_their_bits(kernels):
    """Rows past 512 keys are attended in splits of 512 keys, combined in split order: still within
    float32 rounding of the exact attention, and a row's bits its own alone, among others and on any
    thread count (windows narrow the splits; a window's first block can start mid-split)."""
    lens = [1300, 700, 30, 513]
    k_cache, v_cache, tables = cache_and_tables(lens, 2, 64, seed=7)
    q = torch.randn(len(lens), 6, 64, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            for window, softcap in ((None, None), (600, None), (1100, 30.0)):
                expected = reference(q, k_cache, v_cache, tables, lens, 0.125, window, softcap)
                whole = run(q, k_cache, v_cache, tables, lens, 0.125, window, softcap, isa)
                torch.testing.assert_close(whole.double(), expected, atol=2e-6, rtol=1e-5)
                for r in range(len(lens)):
                    alone = run(q[r:r + 1], k_cache, v_cache, tables[r:r + 1], lens[r:r + 1], 0.125, window, softcap,
                                isa)
                    assert torch.equal(alone, whole[r:r + 1]), (isa, r, window)
                torch.set_num_threads(3)
                assert torch.equal(run(q, k_cache, v_cache, tables, lens, 0.125, window, softcap, isa), whole)
                torch.set_num_threads(1)
    finally:
        torch.set_num_threads(threads)
