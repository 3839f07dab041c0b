"""BlockManager invariants: reference counts, no double free, LRU eviction, prefix matching and the
hash-collision guard."""

from __future__ import annotations

import pytest

from opentgi.engine.scheduling import block_manager as bm_module
from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.sequence import Sequence
from tests.helpers.engine import make_seq


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit and 'compute' the whole sequence, as the engine does."""
    bm.admit(seq)
    assert bm.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    free = set(bm.free_block_ids)
    evictable = set(bm.evictable)
    assert not free & evictable
    for b in bm.blocks:
        in_use = b.ref_count > 0
        assert in_use + (b.block_id in free) + (b.block_id in evictable) == 1, b.block_id
    for h, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == h
    assert bm.num_free_blocks + sum(1 for r in refs if r) == bm.num_blocks


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(10)))  # 3 blocks
    run_prefill(bm, a)
    assert len(a.block_table) == 3
    assert bm.num_used_blocks == 3
    check_invariants(bm, [a])
    bm.free(a)
    check_invariants(bm, [])
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 2  # the two full blocks keep their content


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a)


def test_prefix_sharing_reference_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    a = make_seq(prompt)
    run_prefill(bm, a)
    b = make_seq(prompt)
    cached = bm.admit(b)
    assert cached == 12
    assert b.block_table == a.block_table[:3]
    for block_id in a.block_table[:3]:
        assert bm.blocks[block_id].ref_count == 2
    assert bm.allocate_slots(b, b.num_uncomputed_tokens)
    assert b.block_table[3] != a.block_table[3]  # the partial last block is never shared
    check_invariants(bm, [a, b])
    bm.free(a)
    check_invariants(bm, [b])
    bm.free(b)
    check_invariants(bm, [])


def test_full_prompt_match_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(8))  # exactly two blocks
    a = make_seq(prompt)
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq(prompt)
    assert bm.admit(b) == 4  # the second block holds the last token: recomputed
    assert b.num_uncomputed_tokens == 4


def test_lru_eviction_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])  # block of [1,2] full, [3] partial
    b = make_seq([5, 6, 7])
    run_prefill(bm, a)
    run_prefill(bm, b)
    a_full, b_full = a.block_table[0], b.block_table[0]
    bm.free(a)  # a's full block freed first: least recently used
    bm.free(b)
    assert list(bm.evictable) == [a_full, b_full]
    c = make_seq([9, 10, 11, 12, 13, 14, 15])
    bm.admit(c)
    assert bm.allocate_slots(c, 5)  # 3 blocks: the 2 empty ones, then one evicted
    assert a_full not in bm.evictable and b_full in bm.evictable  # a's evicted first
    assert bm.match_prefix([1, 2, 3], 2) == ([], [])
    assert bm.match_prefix([5, 6, 7], 2)[0] == [b_full]
    check_invariants(bm, [c])


def test_reuse_refreshes_lru_position():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = make_seq([1, 2, 0]), make_seq([3, 4, 0])
    run_prefill(bm, a)
    a_full = a.block_table[0]
    bm.free(a)
    run_prefill(bm, b)
    b_full = b.block_table[0]
    bm.free(b)
    a2 = make_seq([1, 2, 0])
    run_prefill(bm, a2)  # takes a's block back
    assert a2.block_table[0] == a_full
    bm.free(a2)
    assert list(bm.evictable)[-1] == a_full  # now the most recently freed
    d = make_seq([7, 8, 9, 9, 9])
    bm.admit(d)
    assert bm.allocate_slots(d, 3)
    assert b_full not in bm.evictable  # b's was the oldest
    check_invariants(bm, [d])


def test_out_of_blocks_takes_nothing():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.admit(a)
    assert not bm.allocate_slots(a, 5)
    assert a.block_table == []
    check_invariants(bm, [a])


def test_hash_collision_never_reuses_wrong_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: 42)  # everything collides
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3])
    run_prefill(bm, a)
    b = make_seq([8, 9, 3])  # same hash, different tokens
    assert bm.admit(b) == 0
    assert b.block_table == []
    c = make_seq([1, 2, 3])
    assert bm.admit(c) == 2  # the genuine match still works
    check_invariants(bm, [a, c])


def test_prefix_caching_off_frees_content():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3])
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0
    assert bm.admit(make_seq([1, 2, 3])) == 0


def test_identical_prompts_computed_side_by_side_keep_one_findable_block():
    """Found by the block-manager state machine (tests/engine/test_properties_block_manager.py): two
    sequences with the same prompt computed in the same step used to keep two copies of each full
    block, only the first registered; once the first was freed and evicted, the prefix the second
    still held was not found any more (its n > 1 siblings recomputed the prompt)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 1, 1]), make_seq([1, 1, 1])
    for s in (a, b):
        bm.admit(s)
        assert bm.allocate_slots(s, 3)
    for s in (a, b):
        s.num_computed_tokens = 3
        bm.commit(s)
    assert a.block_table[0] == b.block_table[0]  # b's copy swapped for the registered block
    check_invariants(bm, [a, b])
    bm.free(a)
    c = make_seq([5, 5, 5, 5])  # takes every block that is not held
    run_prefill(bm, c)
    check_invariants(bm, [b, c])
    sibling = make_seq([1, 1, 1])
    assert bm.admit(sibling) == 2
    assert sibling.block_table == b.block_table[:1]


def test_lowest_free_block_first_so_the_written_pool_stays_the_working_set():
    """The CPU pool's pages become resident only when written: allocation reuses the lowest freed
    block instead of walking on through the pool (a FIFO free list reached every block in turn)."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    for _ in range(20):  # one short request after another
        s = make_seq(list(range(10)))
        run_prefill(bm, s)
        assert s.block_table == [0, 1, 2]
        bm.free(s)
    assert bm.num_touched_blocks == 3
    a, b = make_seq(list(range(10))), make_seq(list(range(20, 30)))
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5]) and bm.num_touched_blocks == 6
    bm.free(a)
    c = make_seq(list(range(4)))
    run_prefill(bm, c)
    assert c.block_table == [0]
    check_invariants(bm, [b, c])


def test_past_the_cache_growth_limit_cached_blocks_are_evicted_before_a_never_written_block_is_used():
    bm = BlockManager(num_blocks=16, block_size=2, cache_growth_limit=3)
    a = make_seq([1, 2, 3, 4, 5])  # blocks 0, 1 full (cached when freed), 2 partial
    run_prefill(bm, a)
    bm.free(a)
    assert sorted(bm.evictable) == [0, 1] and bm.num_touched_blocks == 3
    b = make_seq([7, 8, 9, 9, 9])  # 3 blocks: the written free one (2), then evictions (LRU: 1, 0)
    bm.admit(b)
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [2, 1, 0] and bm.num_touched_blocks == 3 and not bm.evictable
    c = make_seq([11, 12, 13])  # nothing written is free any more: the pool grows
    run_prefill(bm, c)
    assert c.block_table == [3, 4] and bm.num_touched_blocks == 5
    check_invariants(bm, [b, c])


def test_below_the_cache_growth_limit_cached_prefixes_stay_and_the_pool_grows():
    bm = BlockManager(num_blocks=16, block_size=2, cache_growth_limit=8)
    a = make_seq([1, 2, 3, 4, 5])  # blocks 0, 1 cached when freed, 2 partial
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq([7, 8, 9, 9, 9])  # the written free block 2, then never-used 3, 4 (written: 5 < 8)
    run_prefill(bm, b)
    assert b.block_table == [2, 3, 4] and sorted(bm.evictable) == [0, 1]
    bm.free(b)
    c = make_seq([11, 12, 13, 14, 15, 16, 17, 18, 19])  # 5 blocks: 4 (written), 5, 6, 7, then evict a's tail (LRU)
    run_prefill(bm, c)
    assert c.block_table == [4, 5, 6, 7, 1] and bm.num_touched_blocks == 8
    assert bm.match_prefix([7, 8, 9, 9, 9], 4)[0] == [2, 3]  # b's prefix still cached
    check_invariants(bm, [c])
