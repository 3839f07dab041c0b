"""The torch attention backend against naive attention over contiguous keys."""

from __future__ import annotations

import math
import random

import pytest
import torch

from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.selector import select_backend, select_block_size
from opentgi.models.attention.torch_backend import TorchAttentionBackend
from opentgi.models.attention.torch_plan import make_plan
from tests.helpers.cpu_kernels import torch_runs_avx512_kernels

NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, DIM = 128, 16, 4, 2, 8


def naive_attention(q, keys, values, window=None):
    """q [n, H, D] at the last n positions of keys/values [ctx, Hkv, D]."""
    n, ctx = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[2])
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


class PagedSequences:
    """Sequences with random (scattered) block tables and their full k/v kept contiguously too;
    the caches in `cache_dtype`, the new keys and values rounded to `round_to` first when given."""

    def __init__(self, seed: int, cache_dtype: torch.dtype = torch.float32, backend=None,
                 round_to: torch.dtype | None = None):
        self.rng = random.Random(seed)
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype=cache_dtype)
        self.v_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype=cache_dtype)
        self.backend, self.round_to = backend or TorchAttentionBackend(), round_to
        self.tables: list[list[int]] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def add(self) -> int:
        self.tables.append([])
        self.keys.append(torch.zeros(0, KV_HEADS, DIM))
        self.values.append(torch.zeros(0, KV_HEADS, DIM))
        return len(self.tables) - 1

    def step(self, new_lens: dict[int, int], window=None):
        """Run one step where sequence s gets new_lens[s] tokens; return (out, expected)."""
        seqs = list(new_lens)
        q_parts, k_parts, v_parts, slots, expected = [], [], [], [], []
        for s in seqs:
            n = new_lens[s]
            start = self.keys[s].shape[0]
            while len(self.tables[s]) * BLOCK_SIZE < start + n:
                self.tables[s].append(self.free.pop())
            q, k, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM)
            if self.round_to is not None:
                k, v = k.to(self.round_to).float(), v.to(self.round_to).float()
            self.keys[s] = torch.cat([self.keys[s], k])
            self.values[s] = torch.cat([self.values[s], v])
            q_parts.append(q), k_parts.append(k), v_parts.append(v)
            slots += [self.tables[s][t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
                      for t in range(start, start + n)]
            expected.append(naive_attention(q, self.keys[s], self.values[s], window))
        ctx = [self.keys[s].shape[0] for s in seqs]
        q_lens = [new_lens[s] for s in seqs]
        width = max(len(self.tables[s]) for s in seqs) + 1
        tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(self.tables[s])] = torch.tensor(self.tables[s])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            cu_seqlens_q=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0] + list(torch.tensor(ctx).cumsum(0)), dtype=torch.int32),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx),
            context_lens=torch.tensor(ctx, dtype=torch.int32), block_tables=tables,
            decode_only=all(n == 1 for n in q_lens))
        out = self.backend.forward(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), self.k_cache,
                                   self.v_cache, meta, 1 / math.sqrt(DIM), sliding_window=window)
        return out, torch.cat(expected)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_chunks_and_decode_match_naive_attention(window):
    paged = PagedSequences(seed=1)
    a, b, c = paged.add(), paged.add(), paged.add()
    steps = [
        {a: 7, b: 33},  # two whole prompts, unaligned lengths
        {a: 1, b: 1},  # decode
        {a: 1, b: 20, c: 16},  # decode + a chunk continuing b's cache + a new prompt
        {a: 1, b: 1, c: 1},
        {c: 3, a: 1},  # a small chunk in a mixed step
        {a: 1, b: 1, c: 1},
    ]
    for new_lens in steps:
        out, expected = paged.step(new_lens, window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def attend_steps(steps, cache_dtype, round_to=None, backend=None):
    """Each step's output, and the k cache left, for the same random tokens (seeded)."""
    torch.manual_seed(5)
    paged = PagedSequences(seed=2, cache_dtype=cache_dtype, backend=backend, round_to=round_to)
    for _ in range(3):
        paged.add()
    return [paged.step(new_lens)[0] for new_lens in steps], paged.k_cache


# fresh prompts (batched or, with batch invariance, in segments), a chunk after cached keys, decode rows
MIXED_STEPS = [{0: 7, 1: 33}, {0: 1, 1: 1}, {0: 1, 1: 20, 2: 16}, {2: 3, 0: 1}, {0: 1, 1: 1, 2: 1}]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_float16_caches_are_attended_as_stored_in_every_form(batch_invariant):
    """--kv-cache-dtype float16 under float32 queries: every form, those that attend this step's keys
    without reading the cache included, sees keys and values as the cache stores them: the bits a
    float32 cache gives keys and values rounded to float16 beforehand."""
    backend = TorchAttentionBackend()
    backend.batch_invariant = batch_invariant
    half, half_cache = attend_steps(MIXED_STEPS, torch.float16, backend=backend)
    full, full_cache = attend_steps(MIXED_STEPS, torch.float32, round_to=torch.float16, backend=backend)
    assert half_cache.dtype == torch.float16 and torch.equal(half_cache.float(), full_cache)
    for a, b in zip(half, full, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_decode_batch_with_different_lengths():
    paged = PagedSequences(seed=2)
    seqs = [paged.add() for _ in range(5)]
    paged.step({s: n for s, n in zip(seqs, [1, 15, 16, 17, 40])})
    for _ in range(3):
        out, expected = paged.step({s: 1 for s in seqs})
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _group_cost(groups, lens, block_size):
    from opentgi.models.attention.torch_plan import GROUP_COST_KEYS

    return sum(GROUP_COST_KEYS + len(g) * -(-max(lens[i] for i in g) // block_size) * block_size for g in groups)


def _partitions(items):
    """Every way to cut the sequence `items` into contiguous non-empty runs."""
    if not items:
        yield []
        return
    for k in range(1, len(items) + 1):
        for rest in _partitions(items[k:]):
            yield [items[:k]] + rest


def test_decode_groups_minimise_the_modelled_cost():
    import random

    from opentgi.models.attention.torch_plan import decode_groups

    rng = random.Random(0)
    for _ in range(40):
        lens = [rng.choice([rng.randint(1, 64), rng.randint(1, 2000)]) for _ in range(rng.randint(1, 9))]
        groups = decode_groups(list(range(len(lens))), lens, 16)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        assert all(g == sorted(g) for g in groups)  # batch order within a group
        assert [lens[i] for g in groups for i in sorted(g, key=lambda i: -lens[i])] == [lens[i] for i in order]
        assert all(min(lens[i] for i in g) >= max(lens[i] for i in h) for g, h in zip(groups, groups[1:]))
        best = min(_group_cost(p, lens, 16) for p in _partitions(order))
        assert _group_cost(groups, lens, 16) == best


def test_decode_groups_few_for_short_contexts_several_for_spread_ones():
    from opentgi.models.attention.torch_plan import decode_groups

    short = list(range(10, 41))  # 31 rows in 3 block counts: padding is cheaper than more calls
    assert decode_groups(list(range(len(short))), short, 16) == [list(range(len(short)))]  # in batch order
    spread = [3000] * 8 + [1500] * 8 + [100] * 40
    groups = decode_groups(list(range(len(spread))), spread, 16)
    assert [[spread[i] for i in g] for g in groups] == [[3000] * 8, [1500] * 8, [100] * 40]


@pytest.mark.parametrize("window", [None, 5])
def test_decode_groups_by_length_match_naive_attention(window):
    # lengths shrinking many times (more groups than the backend makes), equal lengths (no mask),
    # and a prefill chunk in the same step
    paged = PagedSequences(seed=4)
    lengths = [1, 2, 3, 5, 9, 17, 33, 65, 129, 33, 33, 40, 45, 52, 60, 70, 80, 92, 106, 148, 170]
    seqs = [paged.add() for _ in lengths]
    paged.step({s: n for s, n in zip(seqs, lengths)}, window)
    for chunk in (None, 7):
        new_lens = {s: 1 for s in seqs}
        if chunk:
            new_lens[seqs[0]] = chunk
        out, expected = paged.step(new_lens, window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    equal = PagedSequences(seed=5)
    pair = [equal.add(), equal.add()]
    equal.step({s: 20 for s in pair}, window)
    out, expected = equal.step({s: 1 for s in pair}, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_slots_marked_minus_one_are_not_written():
    paged = PagedSequences(seed=3)
    s = paged.add()
    paged.step({s: 4})
    before = paged.k_cache.clone()
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([-1], dtype=torch.long), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=4,
        context_lens=torch.tensor([4], dtype=torch.int32),
        block_tables=torch.tensor([paged.tables[s]], dtype=torch.int32), decode_only=True)
    q = torch.randn(1, HEADS, DIM)
    out = TorchAttentionBackend().forward(q, torch.randn(1, KV_HEADS, DIM), torch.randn(1, KV_HEADS, DIM),
                                          paged.k_cache, paged.v_cache, meta, 1 / math.sqrt(DIM))
    assert torch.equal(paged.k_cache, before)
    torch.testing.assert_close(out, naive_attention(q, paged.keys[s], paged.values[s]), atol=1e-5, rtol=1e-5)


def test_selector_uses_torch_on_cpu_with_block_size_16():
    backend = select_backend(torch.device("cpu"))
    assert backend.name == "torch"
    assert select_block_size(backend, None) == 16
    assert select_block_size(backend, 32) == 32
    with pytest.raises(ValueError):
        select_block_size(backend, 0)


def test_decode_never_reads_stale_nonfinite_cache_contents():
    # blocks freed by an earlier request that produced non-finite k/v: decode attends whole blocks
    # (masked past each context), so those leftovers must never reach a row's keys
    paged = PagedSequences(seed=6)
    paged.k_cache.fill_(float("nan"))
    paged.v_cache.fill_(float("inf"))
    seqs = [paged.add() for _ in range(4)]
    paged.step({s: n for s, n in zip(seqs, [3, 17, 40, 16])})
    for _ in range(3):
        out, expected = paged.step({s: 1 for s in seqs})
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out, expected = paged.step({seqs[0]: 1, seqs[1]: 5})  # a verify-like row next to a decode
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prompt_batches_pad_at_most_to_twice_a_prompt():
    from opentgi.models.attention.torch_plan import prompt_batches

    spans, start = [], 0
    for n in [7, 40, 21, 20, 3, 128, 64, 65, 2, 1]:
        spans.append((start, start + n))
        start += n
    batches = prompt_batches(spans)
    assert sorted(s for b in batches for s in b) == sorted(spans)
    lens = [[e - s for s, e in b] for b in batches]
    assert lens == [[128, 65], [64, 40], [21, 20], [7], [3, 2], [1]]
    assert all(2 * min(b) > max(b) for b in lens if len(b) > 1)


@pytest.mark.parametrize("window", [None, 12])
def test_fresh_prompts_attended_in_batches_match_naive_attention(window):
    # fresh prompts of many lengths (several batches, a lone one, one over MAX_BATCHED_PROMPT, some
    # longer than the window) next to decode rows and a chunk after a cached prefix
    from opentgi.models.attention.torch_plan import MAX_BATCHED_PROMPT

    paged = PagedSequences(seed=7)
    old = [paged.add() for _ in range(2)]
    paged.step({old[0]: 9, old[1]: 30}, window)
    lengths = [2, 3, 5, 8, 11, 11, 12, 30, 31, 50, 64, MAX_BATCHED_PROMPT + 3]
    new = [paged.add() for _ in lengths]
    step = {old[0]: 1, old[1]: 6} | {s: n for s, n in zip(new, lengths)}
    out, expected = paged.step(step, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out, expected = paged.step({s: 1 for s in old + new}, window)  # their caches were written
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fresh_prompts_in_a_batch_get_the_numbers_they_get_alone(monkeypatch):
    # padding keys are masked (exp(-inf) = 0): in bfloat16 the batched call gives each prompt
    # bit for bit what attending it alone gives
    import opentgi.models.attention.torch_plan as plan_module

    gen = torch.Generator().manual_seed(8)
    lengths = [6, 9, 11, 7, 10, 8]
    total = sum(lengths)
    q = torch.randn(total, 9, 64, generator=gen).bfloat16()
    k = torch.randn(total, 3, 64, generator=gen).bfloat16()
    v = torch.randn(total, 3, 64, generator=gen).bfloat16()
    tables = torch.arange(len(lengths), dtype=torch.int32).unsqueeze(1)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    slots = torch.cat([torch.arange(n) + b * BLOCK_SIZE for b, n in enumerate(lengths)])

    def run():
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                 max_seqlen_k=max(lengths), context_lens=torch.tensor(lengths, dtype=torch.int32),
                                 block_tables=tables, decode_only=False)
        k_cache = torch.zeros(len(lengths), BLOCK_SIZE, 3, 64, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        return TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125), meta

    batched, meta = run()
    assert len(meta.scratch[("torch", None, torch.bfloat16, 3)].prompts) == 1
    monkeypatch.setattr(plan_module, "MAX_BATCHED_PROMPT", 0)
    alone, meta = run()
    assert not meta.scratch[("torch", None, torch.bfloat16, 3)].prompts
    # Padded batches serve only --nondeterministic steps (batch invariance attends every token in
    # its own form: docs/determinism.md). sdpa's AVX-512 kernels give the masked batch each
    # prompt's bits; its AVX2 ones (a CPU without AVX-512) give a few outputs another last bit.
    if torch_runs_avx512_kernels():
        assert torch.equal(batched, alone)
    else:
        torch.testing.assert_close(batched, alone, atol=0, rtol=2 ** -7)  # one bfloat16 ulp at most


@pytest.mark.parametrize("skip", [False, True])
def test_a_step_of_decode_rows_gets_the_native_plan_the_general_loop_builds(skip):
    # contexts whose new token is its block's first (a tail to clear), inside a block, a block's last
    tables = torch.tensor([[3, 7, -1], [5, -1, -1], [9, 2, 4]], dtype=torch.int32)
    ctx = [17, 5, 32]
    slots = [-1 if skip else 7 * 16, 5 * 16 + 4, 2 * 16 + 15]

    def plan(decode_only: bool):  # decode_only=False: the general loop (one new token a row all the same)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 17, 22, 54], dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=32,
            context_lens=torch.tensor(ctx, dtype=torch.int32), block_tables=tables, decode_only=decode_only,
            prompt_new_tokens=[0, 0, 0])
        return make_plan(meta, 16, None, torch.float32, 2, batch_invariant=True, prompt_form=True, native=True)

    fast, loop = plan(True), plan(False)
    assert fast.native is not None and loop.native is not None
    for name in ("tokens", "seq", "ctx", "block_tables"):
        a, b = getattr(fast.native, name), getattr(loop.native, name)
        assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b), name
    assert fast.native.in_order and loop.native.in_order
    assert torch.equal(fast.tails, loop.tails) and fast.tails.tolist() == list(range(7 * 16 + 1, 8 * 16))
    assert (fast.has_skips, fast.decode_in_order) == (loop.has_skips, loop.decode_in_order) == (skip, False)
    assert fast.decode_tokens is None and loop.decode_tokens is None and fast.decode_blocks is None
    assert [fast.decode, fast.prefill, fast.prompts, fast.segments, fast.prompt_segments] == [[]] * 5
    assert [loop.decode, loop.prefill, loop.prompts, loop.segments, loop.prompt_segments] == [[]] * 5
