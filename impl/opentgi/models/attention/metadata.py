"""The attention interface's per-step inputs, built by the engine's model runner.

A step packs the new tokens of B sequences into one flat batch of T tokens ("varlen" layout, as
flash-attn wants it). Sequence b owns q positions cu_seqlens_q[b]:cu_seqlens_q[b+1]; its keys are
the first context_lens[b] tokens of its paged KV (the cached ones and this step's new ones), found
through block_tables[b]. KV caches are per layer, shaped [num_blocks, block_size, num_kv_heads,
head_dim]; token t of a sequence lives in slot block_table[t // block_size] * block_size
+ t % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: where each new token's k/v is written; -1 = skip
    cu_seqlens_q: torch.Tensor  # int32 [B+1]: prefix sums of new-token counts
    cu_seqlens_k: torch.Tensor  # int32 [B+1]: prefix sums of context_lens
    max_seqlen_q: int
    max_seqlen_k: int
    context_lens: torch.Tensor  # int32 [B]: tokens in the KV after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with -1 (CPU) / 0 (flash)
    decode_only: bool  # every sequence has exactly one new token
    # how many of each sequence's new tokens are prompt tokens (they come first): a backend may
    # attend prompt tokens in another batch-invariant form than generated ones (torch_backend.py);
    # None: not told, every token in the generated tokens' form
    prompt_new_tokens: list[int] | None = None
    # image tokens that attend each other both ways (Gemma 3: attention/bidirectional.py): one
    # (flat row of the first, sequence b, its position, one past the last one's, the image's
    # first position, one past its last) per image a step feeds; None: all causal
    image_spans: list[tuple[int, int, int, int, int, int]] | None = None
    # Per-step data a backend derives from the fields above once and reuses in every layer (e.g.
    # the torch backend's gathered block ids and masks). The model runner leaves it empty.
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
