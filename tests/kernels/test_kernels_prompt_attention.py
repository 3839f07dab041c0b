"""Paged prompt attention (`opentgi::prompt_attention`, kernels/csrc/attention.h) and the native
backend's prompt tokens: against a float64 reference over fragmented block tables, prefix-cache
tails, windows and soft-caps; bitwise the same numbers however a prompt is split into steps,
among other rows, on any thread count and block size, on every ISA path this CPU has."""

from __future__ import annotations

import math

import pytest
import torch

from opentgi.kernels import native
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.native_backend import NativeAttentionBackend

torch.set_num_threads(1)


def paged(keys: torch.Tensor, values: torch.Tensor, block: int, seed: int):
    """Sequences' keys/values [seqs, positions, kv_heads, D] stored in a paged cache of `block`-sized
    blocks scattered over the pool (a fragmented table per sequence, padded with -1)."""
    seqs, n = keys.shape[:2]
    per = -(-n // block)
    pool = seqs * per + 3
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))
    tables = torch.full((seqs, per + 2), -1, dtype=torch.int32)
    k_cache = torch.zeros(pool, block, *keys.shape[2:], dtype=keys.dtype)
    v_cache = torch.zeros_like(k_cache)
    for s in range(seqs):
        tables[s, :per] = order[s * per:(s + 1) * per].to(torch.int32)
        for p in range(n):
            k_cache[tables[s, p // block], p % block] = keys[s, p]
            v_cache[tables[s, p // block], p % block] = values[s, p]
    return k_cache, v_cache, tables


def reference(q, keys, values, seq, ctx, scale, window=None, softcap=None):
    """float64: row r's query over positions < ctx[r] of sequence seq[r] (the last `window` of them)."""
    group = q.shape[1] // keys.shape[2]
    outs = []
    for r in range(q.shape[0]):
        n = int(ctx[r])
        k = keys[int(seq[r]), :n].double().repeat_interleave(group, 1)
        v = values[int(seq[r]), :n].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[r].double(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if window is not None:
            s[:, torch.arange(n) <= n - 1 - window] = -math.inf
        outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), v))
    return torch.stack(outs)


def data(seqs=2, n=150, kv_heads=2, group=3, dim=64, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(seqs, n, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(seqs, n, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(seqs * n, kv_heads * group, dim, generator=gen)
    return keys, values, q


def attend(q, k_cache, v_cache, tables, seq, ctx, scale, window=None, softcap=None, isa=None):
    return native.prompt_attention(q, k_cache, v_cache, tables, torch.tensor(seq, dtype=torch.int32),
                                   torch.tensor(ctx, dtype=torch.int32), scale, window, softcap, isa)


@pytest.mark.parametrize(("group", "dim", "window", "softcap", "dtype"), [
    (3, 64, None, None, torch.float32), (4, 20, 37, None, torch.float32), (1, 64, None, 30.0, torch.bfloat16),
    (2, 8, 70, 5.0, torch.float16)])
def test_matches_float64_over_fragmented_tables_and_prefix_tails(kernels, group, dim, window, softcap, dtype):
    keys, values, q = data(group=group, dim=dim, seed=group + dim)
    k_cache, v_cache, tables = paged(keys, values, 16, seed=1)
    # sequence 0: a whole prompt of 150; sequence 1: the last 61 of 150 after a cached prefix
    # (a prefix-cache tail), its rows interleaved with sequence 0's in the call
    rows = [(0, p) for p in range(150)] + [(1, p) for p in range(89, 150)]
    rows = rows[::2] + rows[1::2]
    seq, ctx = [s for s, _ in rows], [p + 1 for _, p in rows]
    qr = q[:len(rows)]
    expected = reference(qr, keys, values, seq, ctx, dim ** -0.5, window, softcap)
    for isa in native.supported_isas():
        out = attend(qr, k_cache, v_cache, tables, seq, ctx, dim ** -0.5, window, softcap, isa)
        torch.testing.assert_close(out.double(), expected, atol=3e-6, rtol=1e-5)


def test_a_prompt_token_gets_the_same_bits_however_the_prompt_is_split(kernels):
    keys, values, q = data(seqs=1, n=200, kv_heads=2, group=4, dim=64, seed=5)
    k_cache, v_cache, tables = paged(keys, values, 16, seed=6)
    k5, v5, t5 = paged(keys, values, 5, seed=7)  # another block size and table: the same keys
    ctx = list(range(1, 201))
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            for window, softcap in ((None, None), (45, 20.0)):
                whole = attend(q[:200], k_cache, v_cache, tables, [0] * 200, ctx, 0.125, window, softcap, isa)
                for cuts in ((1, 63, 64, 72), (130, 70), (17,) * 11 + (13,)):  # chunks, prefix tails
                    start = 0
                    for n in cuts:
                        part = attend(q[start:start + n], k_cache, v_cache, tables, [0] * n, ctx[start:start + n],
                                      0.125, window, softcap, isa)
                        assert torch.equal(part, whole[start:start + n]), (isa, cuts, start)
                        start += n
                for count in (2, 3):
                    torch.set_num_threads(count)
                    assert torch.equal(attend(q[:200], k_cache, v_cache, tables, [0] * 200, ctx, 0.125, window,
                                              softcap, isa), whole)
                torch.set_num_threads(1)
                assert torch.equal(attend(q[:200], k5, v5, t5, [0] * 200, ctx, 0.125, window, softcap, isa), whole)
                # reversed order: every row alone in its tile
                rev = list(range(199, -1, -1))
                out = attend(q[rev], k_cache, v_cache, tables, [0] * 200, [ctx[r] for r in rev], 0.125, window,
                             softcap, isa)
                assert torch.equal(out, whole[rev])
    finally:
        torch.set_num_threads(threads)


def test_the_backend_attends_prompt_tokens_in_the_prompt_form_and_generated_ones_as_decode_rows(kernels):
    keys, values, q = data(seqs=2, n=40, kv_heads=2, group=2, dim=16, seed=9)
    k_cache, v_cache, tables = paged(keys, values, 16, seed=10)
    backend = NativeAttentionBackend()
    backend.batch_invariant = backend.prompt_form = True
    # one step: sequence 0's prompt tokens 10..29 then its generated tokens 30..31, sequence 1's decode row at 40
    empty = torch.zeros(23, 2, 16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((23,), -1, dtype=torch.long), cu_seqlens_q=torch.tensor([0, 22, 23], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 32, 72], dtype=torch.int32), max_seqlen_q=22, max_seqlen_k=40,
        context_lens=torch.tensor([32, 40], dtype=torch.int32), block_tables=tables, decode_only=False,
        prompt_new_tokens=[20, 0])
    out = backend.forward(q[:23], empty, empty, k_cache, v_cache, meta, 0.25)
    seq, ctx = [0] * 22 + [1], list(range(11, 33)) + [40]
    prompt = attend(q[:20], k_cache, v_cache, tables, seq[:20], ctx[:20], 0.25)
    decode = native.paged_attention(q[20:23], k_cache, v_cache, tables, torch.tensor(seq[20:], dtype=torch.int32),
                                    torch.tensor(ctx[20:], dtype=torch.int32), 0.25)
    assert torch.equal(out[:20], prompt) and torch.equal(out[20:], decode)
    torch.testing.assert_close(out.double(), reference(q[:23], keys, values, seq, ctx, 0.25), atol=3e-6, rtol=1e-5)


def test_bad_tables_are_refused_with_a_clear_error(kernels):
    keys, values, q = data(seqs=1, n=20, kv_heads=1, group=2, dim=8)
    k_cache, v_cache, tables = paged(keys, values, 16, seed=11)
    with pytest.raises(RuntimeError, match="has 200 keys"):
        attend(q[:1], k_cache, v_cache, tables, [0], [200], 1.0)
