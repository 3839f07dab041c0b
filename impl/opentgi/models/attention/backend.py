"""The one attention interface both devices implement (torch on CPU, flash-attn on CUDA)."""

from __future__ import annotations

from typing import Protocol

import torch

from opentgi.models.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """One layer's attention for one step.

        q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (this step's new tokens, varlen
        layout); k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim].
        Writes k/v into the caches at meta.slot_mapping (-1 = skip), then attends causally over
        each sequence's whole context (its first context_lens[b] tokens through block_tables[b]);
        the q tokens of sequence b sit at positions context_lens[b] - q_len_b .. context_lens[b] - 1.
        With `sliding_window` W a query at position i sees keys at positions i - W < j <= i.
        With `softcap` c the logits q.k * scale become tanh(logit / c) * c before the softmax.
        num_heads must be a multiple of num_kv_heads (grouped-query attention).
        Returns [T, num_heads, head_dim] in q's dtype.
        """


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, has_skips: bool) -> None:
    """Store this step's keys/values in their slots (device-agnostic). `has_skips`: some slots
    are -1 and must be left out (computed once per step by the caller, to avoid a sync per layer)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if has_skips:
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    flat_k.index_copy_(0, slot_mapping, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(flat_v.dtype))
