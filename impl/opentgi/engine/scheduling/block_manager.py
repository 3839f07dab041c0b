"""Paged KV cache bookkeeping: which block holds which tokens, who references it, what can be reused.

Blocks are reference counted. A full block whose tokens are all computed is registered in the
prefix cache under hash(parent block's hash, its token ids); the ids are stored too, so a hash
collision never hands out the wrong k/v. A block holding image tokens (all alike: the model's
image placeholder) is keyed by the content hash of each image too (`block_key`), so only the same
image at the same place shares it. A block nobody references any more keeps its content and
its hash (when prefix caching is on) and waits in an LRU list: a later prompt with the same prefix
takes it back, and allocation evicts the least recently freed one first. Sequences never write into
a shared block: only full blocks are shared, and a prefix match always leaves the prompt's last
token to compute.

With `prompt_blocks_only` (a model whose kernels follow the row kind, batch-invariant:
docs/determinism.md) only blocks of prompt tokens are registered and matched: a generated token's
k/v comes from the generated rows' kernel, and a later prompt holding the same tokens computes them
with the prompt rows' kernel, so serving one for the other would change that prompt's numbers.

Allocation hands out the lowest free block id first and reuses a block already written before it
reaches into a block never used: the CPU pool's pages become resident only when first written
(kv_cache.py), so the written part of the pool stays the working set plus the cache. To keep cached
prefixes, the written part may grow up to `cache_growth_limit` blocks; past it a cached block is
evicted (least recently freed first) before a block never used is taken, so the pool grows further
only for sequences that need room.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from opentgi.engine.scheduling.sequence import Sequence


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def block_key(token_ids: list[int], images, index: int, block_size: int) -> tuple:
    """What identifies the tokens of block `index`: their ids, then (content hash, start) of each
    image (ImageInput) whose tokens it holds."""
    lo, hi = index * block_size, (index + 1) * block_size
    key = tuple(token_ids[lo:hi])
    marks = tuple((image.content_hash, image.start) for image in images if image.start < hi and image.end > lo)
    return key + marks if marks else key


def root_hash(seq: Sequence) -> int | None:
    """The parent hash of a sequence's first block: its LoRA adapter's, so that two adapters (or an
    adapter and the base model), whose k/v differ for the same tokens, never share a block."""
    adapter = seq.request.adapter_id
    return None if adapter is None else hash(("lora-adapter", adapter))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_growth_limit: int | None = None, prompt_blocks_only: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks}x{block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prompt_blocks_only = prompt_blocks_only
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: list[int] = list(range(num_blocks))  # a heap: empty, no reusable content
        self.num_touched_blocks = 0  # ids below it have been handed out (written) at least once
        # how far cached prefixes may grow the written part of the pool (None: the whole pool)
        self.cache_growth_limit = num_blocks if cache_growth_limit is None else cache_growth_limit
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, hashed; LRU first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # --- accounting ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (empty ones and evictable cached ones)."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    # --- prefix cache ----------------------------------------------------------------------------
    def _lookup(self, h: int, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.hash_to_block.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids:  # hash collision: different tokens, never reuse
            return None
        return block_id

    def match_prefix(self, token_ids: list[int], max_tokens: int,
                     root: int | None = None, images=()) -> tuple[list[int], list[int]]:
        """Cached blocks holding the longest prefix of token_ids of at most max_tokens tokens, under
        the given root hash (`root_hash`), with the prompt's `images` (`block_key`): (block ids,
        their hashes). Takes no reference."""
        bs = self.block_size
        block_ids: list[int] = []
        hashes: list[int] = []
        parent: int | None = root
        for i in range(max_tokens // bs):
            chunk = block_key(token_ids, images, i, bs)
            h = block_hash(parent, chunk)
            block_id = self._lookup(h, chunk)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent = h
        return block_ids, hashes

    def admit(self, seq: Sequence, *, use_prefix_cache: bool = True) -> int:
        """Give a waiting sequence (no blocks yet) the cached blocks of its longest cached prefix.
        Always leaves at least the last token to compute (its logits are needed). Returns the
        number of tokens found cached."""
        assert not seq.block_table, "admit() of a sequence that holds blocks"
        n = len(seq.token_ids)
        limit = min(n - 1, seq.num_prompt_tokens) if self.prompt_blocks_only else n - 1
        block_ids, hashes = self.match_prefix(seq.token_ids, limit, root_hash(seq), seq.request.images) \
            if use_prefix_cache else ([], [])
        for block_id in block_ids:
            self._ref(block_id)
        seq.block_table = block_ids
        seq.block_hashes = hashes
        seq.num_hashed_blocks = len(block_ids)
        seq.num_computed_tokens = seq.num_cached_tokens = len(block_ids) * self.block_size
        self.prefix_query_tokens += n
        self.prefix_hit_tokens += seq.num_cached_tokens
        if seq.num_prompt_cached_tokens is None:
            seq.num_prompt_cached_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
        return seq.num_cached_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache. A block whose
        prefix another block already holds (identical prompts computed side by side) is swapped
        for that one and freed: one block per prefix, so the prefix stays findable as long as any
        sequence holds it."""
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if self.prompt_blocks_only:
            num_full = min(num_full, seq.num_prompt_tokens // bs)
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq)
        for i in range(seq.num_hashed_blocks, num_full):
            chunk = block_key(seq.token_ids, seq.request.images, i, bs)
            h = block_hash(parent, chunk)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block:
                block.hash = h
                block.token_ids = chunk
                self.hash_to_block[h] = block.block_id
            else:
                same = self._lookup(h, chunk)
                if same is not None and same != block.block_id:
                    self._ref(same)
                    seq.block_table[i] = same
                    self._unref(block)
            seq.block_hashes.append(h)
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    # --- allocation ----------------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id, None)
        block.ref_count += 1

    def _take_free_block(self) -> int:
        """The lowest free block already written; else the lowest block never used while the
        written part is below `cache_growth_limit`; else the least recently freed cached block;
        else the lowest block never used."""
        free = self.free_block_ids
        if free and (free[0] < self.num_touched_blocks or not self.evictable
                     or self.num_touched_blocks < self.cache_growth_limit):
            block_id = heapq.heappop(free)
            self.num_touched_blocks = max(self.num_touched_blocks, block_id + 1)
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently freed
            self._forget(self.blocks[block_id])
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash = None
        block.token_ids = None

    def _unref(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block.block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if self.enable_prefix_caching and block.hash is not None \
                    and self.hash_to_block.get(block.hash) == block.block_id:
                self.evictable[block.block_id] = None
            else:
                self._forget(block)
                heapq.heappush(self.free_block_ids, block.block_id)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more computed tokens. False (nothing taken) when the pool
        has too few blocks."""
        needed = self.num_new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (they held only rejected speculative
        drafts: never full of computed tokens, so never hashed)."""
        keep = self.blocks_for(len(seq.token_ids))
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, "trim of a shared or cached block"
            block.ref_count = 0
            heapq.heappush(self.free_block_ids, block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its blocks go to the LRU list (hashed) or the free list.
        Freed in reverse, so a prompt's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            self._unref(self.blocks[block_id])
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
