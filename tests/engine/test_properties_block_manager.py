"""Property test of the BlockManager and its prefix cache: a hypothesis state machine drives random
admissions, chunked prefills, decodes, n > 1 / best_of siblings, frees, preemptions and evictions
over a small pool and a tiny vocabulary (so prefixes collide often), and checks after every rule:

- every block's reference count equals the number of live holders (block-table entries),
- free + used + cached equals the pool size, each block in exactly one of the three,
- no block is both free (empty or evictable) and held,
- a cached prefix block's hash is the hash of its tokens under its parent's hash, and its k/v slots
  (a shadow cache written as the engine would) hold exactly those tokens,
- every live sequence reads its own tokens back from its blocks (sharing never hands out another
  prefix's k/v, and no sequence writes into a block someone else holds),
- a full block a running sequence holds is found by its prefix, and one prefix lives in one block
  (identical prompts computed side by side used to keep two copies, one of them unfindable),
- freeing everything returns the pool to empty (a rule, and the teardown).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.block_manager import BlockManager, block_hash
from opentgi.engine.scheduling.sequence import Sequence
from tests.helpers.hypothesis_profiles import examples

VOCAB = 3  # few token ids: identical prefixes are common
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14)


def make_seq(prompt: list[int], prompt_logprobs: bool = False) -> Sequence:
    req = GenerationRequest(list(prompt), SamplingParams(), StoppingParams(max_new_tokens=64),
                            prompt_logprobs=prompt_logprobs)
    return Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 1 << 20),
                    processors=[])


def chain_hashes(token_ids: list[int], num_blocks: int, block_size: int) -> list[int]:
    hashes, parent = [], None
    for i in range(num_blocks):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4), prefix_caching=st.booleans(),
                growth=st.one_of(st.none(), st.integers(0, 12)))
    def setup(self, num_blocks: int, block_size: int, prefix_caching: bool, growth: int | None) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                               cache_growth_limit=growth)
        self.running: list[Sequence] = []  # hold blocks
        self.waiting: list[Sequence] = []  # preempted: no blocks, tokens kept, to be admitted again
        self.kv: dict[int, dict[int, int]] = {}  # shadow k/v: block id -> slot -> token written there
        self.prefixes: dict[int, tuple[int, ...]] = {}  # every registered hash -> its whole prefix
        self.fresh = VOCAB  # token ids above the vocabulary: prompts no cache can hold

    # --- helpers -----------------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> bool:
        """The scheduler's admission: cached prefix, then room for the whole rest (or nothing)."""
        bm = self.bm
        use_cache = seq.prompt_logprobs is None
        cached = bm.admit(seq, use_prefix_cache=use_cache)
        assert cached % bm.block_size == 0 and cached < len(seq)
        assert seq.block_table == seq.block_table[:cached // bm.block_size]
        self._check_reads(seq)
        if not bm.allocate_slots(seq, seq.num_uncomputed_tokens):
            bm.free(seq)
            return False
        return True

    def _compute(self, seq: Sequence, n: int) -> None:
        """The model writes k/v for the next n tokens, then the engine commits full blocks."""
        bs = self.bm.block_size
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block_id = seq.block_table[p // bs]
            assert self.bm.blocks[block_id].ref_count == 1, "write into a shared block"
            self.kv.setdefault(block_id, {})[p % bs] = seq.token_ids[p]
        seq.num_computed_tokens += n
        self.bm.commit(seq)
        full = seq.num_computed_tokens // bs
        assert seq.num_hashed_blocks == full
        assert seq.block_hashes == chain_hashes(seq.token_ids, full, bs)
        for i, h in enumerate(seq.block_hashes):
            self.prefixes[h] = tuple(seq.token_ids[:(i + 1) * bs])

    def _check_reads(self, seq: Sequence) -> None:
        bs = self.bm.block_size
        for p in range(seq.num_computed_tokens):
            assert self.kv[seq.block_table[p // bs]][p % bs] == seq.token_ids[p], (seq, p)

    def _pick(self, seqs: list[Sequence], i: int) -> Sequence:
        return seqs[i % len(seqs)]

    # --- rules -------------------------------------------------------------------------------------
    @rule(prompt=tokens, prompt_logprobs=st.booleans())
    def allocate(self, prompt: list[int], prompt_logprobs: bool) -> None:
        seq = make_seq(prompt, prompt_logprobs)
        if self._admit(seq):
            self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def allocate_same(self, i: int) -> None:
        """A request with the prompt of one already running (identical concurrent requests)."""
        other = self._pick(self.running, i)
        self.allocate(other.token_ids[:other.num_prompt_tokens], False)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.running))
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 8))
    def prefill_chunk(self, i: int, chunk: int) -> None:
        pending = [s for s in self.running if s.num_uncomputed_tokens]
        seq = self._pick(pending, i)
        self._compute(seq, min(chunk, seq.num_uncomputed_tokens))

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.running))
    @rule(i=st.integers(0, 99), token=st.integers(0, VOCAB - 1))
    def append(self, i: int, token: int) -> None:
        """A decode: the sampled token is appended, the next step makes room for it and computes it."""
        seq = self._pick([s for s in self.running if not s.num_uncomputed_tokens], i)
        seq.token_ids.append(token)
        if self.bm.allocate_slots(seq, 1):
            self._compute(seq, 1)
        else:
            assert self.bm.num_free_blocks == 0
            self._preempt(seq)

    @precondition(lambda self: any(s.num_computed_tokens >= s.num_prompt_tokens for s in self.running))
    @rule(i=st.integers(0, 99), n=st.integers(1, 3))
    def fork(self, i: int, n: int) -> None:
        """n > 1 / best_of: siblings admitted once sequence 0 computed the prompt share its full blocks."""
        parent = self._pick([s for s in self.running if s.num_computed_tokens >= s.num_prompt_tokens], i)
        prompt = parent.token_ids[:parent.num_prompt_tokens]
        bs = self.bm.block_size
        for _ in range(n):
            sibling = make_seq(prompt)
            if not self._admit(sibling):
                break
            if parent.prompt_logprobs is None:
                # every full block of the prompt but the one holding its last token is shared
                shared = (len(prompt) - 1) // bs
                assert sibling.num_cached_tokens == shared * bs
                self._check_reads(sibling)
            self.running.append(sibling)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        seq = self._pick(self.running, i)
        self.running.remove(seq)
        self.bm.free(seq)
        assert not seq.block_table

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def preempt(self, i: int) -> None:
        self._preempt(self._pick(self.running, i))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 99))
    def resume(self, i: int) -> None:
        """A preempted sequence is admitted again: recomputed, from its cached prefix if any."""
        seq = self._pick(self.waiting, i)
        if self._admit(seq):
            self.waiting.remove(seq)
            self.running.append(seq)

    @rule(size=st.integers(1, 12))
    def evict(self, size: int) -> None:
        """A prompt of fresh tokens takes blocks: free blocks already written (lowest first), then
        blocks never written while the written part is below the cache growth limit, then cached
        ones (evicted), then blocks never written again."""
        bm = self.bm
        cached_before = set(bm.evictable)
        written_free_before = sorted(b for b in bm.free_block_ids if b < bm.num_touched_blocks)
        unwritten_before = sorted(b for b in bm.free_block_ids if b >= bm.num_touched_blocks)
        touched_before = bm.num_touched_blocks
        seq = make_seq(list(range(self.fresh, self.fresh + size * bm.block_size)))
        self.fresh += size * bm.block_size
        if not self._admit(seq):
            assert bm.blocks_for(len(seq)) > bm.num_free_blocks
            return
        taken = set(seq.block_table)
        evicted = taken & cached_before
        n_written = min(len(taken), len(written_free_before))
        n_grown = min(len(taken) - n_written, len(unwritten_before),
                      max(0, bm.cache_growth_limit - touched_before))  # new blocks below the limit
        n_evicted = min(len(cached_before), len(taken) - n_written - n_grown)
        assert len(evicted) == n_evicted
        assert taken - cached_before == set(written_free_before[:n_written]) \
            | set(unwritten_before[:len(taken) - n_written - n_evicted])
        for block_id in evicted:  # evicted: its hash no longer leads to it
            assert bm.blocks[block_id].hash is None and block_id not in bm.hash_to_block.values()
        self.running.append(seq)

    @rule()
    def free_all(self) -> None:
        self._free_everything()

    def _free_everything(self) -> None:
        for seq in self.running:
            self.bm.free(seq)
        self.running = []
        bm = self.bm
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
        assert all(b.ref_count == 0 for b in bm.blocks)
        if not bm.enable_prefix_caching:
            assert not bm.evictable and not bm.hash_to_block

    def teardown(self) -> None:
        if hasattr(self, "bm"):
            self._free_everything()
            self._check_pool()

    # --- invariants --------------------------------------------------------------------------------
    @invariant()
    def refcounts_are_holders(self) -> None:
        holders = [0] * self.bm.num_blocks
        for seq in self.running:
            for block_id in seq.block_table:
                holders[block_id] += 1
        for seq in self.waiting:
            assert not seq.block_table
        assert [b.ref_count for b in self.bm.blocks] == holders

    @invariant()
    def pool_adds_up(self) -> None:
        self._check_pool()

    def _check_pool(self) -> None:
        bm = self.bm
        free = list(bm.free_block_ids)
        cached = list(bm.evictable)
        assert len(set(free)) == len(free) and not set(free) & set(cached)
        used = [b.block_id for b in bm.blocks if b.ref_count > 0]
        assert len(free) + len(used) + len(cached) == bm.num_blocks
        assert not (set(free) | set(cached)) & set(used), "a block both free and held"
        assert bm.num_used_blocks == len(used) and bm.num_cached_blocks == len(cached)
        for block_id in free:
            assert bm.blocks[block_id].hash is None

    @invariant()
    def cached_blocks_hold_their_prefix(self) -> None:
        bm = self.bm
        bs = bm.block_size
        for h, block_id in bm.hash_to_block.items():
            block = bm.blocks[block_id]
            assert block.hash == h
            prefix = self.prefixes[h]
            assert block.token_ids == prefix[-bs:]
            assert chain_hashes(list(prefix), len(prefix) // bs, bs)[-1] == h
            assert [self.kv[block_id][s] for s in range(bs)] == list(block.token_ids)
        for block_id in bm.evictable:
            assert bm.hash_to_block.get(bm.blocks[block_id].hash) == block_id

    @invariant()
    def held_prefixes_are_findable_once(self) -> None:
        """A full block a running sequence holds is found by its prefix (siblings and later prompts
        share it), and one prefix is held in one block."""
        bm = self.bm
        block_of: dict[int, int] = {}
        for seq in self.running:
            for i, h in enumerate(seq.block_hashes):
                assert block_of.setdefault(h, seq.block_table[i]) == seq.block_table[i], "one prefix, two blocks"
                assert bm.hash_to_block.get(h) == seq.block_table[i], "a held prefix the cache cannot find"

    @invariant()
    def sequences_read_their_own_tokens(self) -> None:
        for seq in self.running:
            assert len(seq.block_table) >= self.bm.blocks_for(seq.num_computed_tokens)
            self._check_reads(seq)


BlockManagerMachine.TestCase.settings = settings(max_examples=examples(300), stateful_step_count=50)
test_block_manager = BlockManagerMachine.TestCase
