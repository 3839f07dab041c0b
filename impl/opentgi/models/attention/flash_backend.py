"""The CUDA attention backend: flash-attn's paged kernels (flash-attn >= 2.6, `opentgi[cuda]`).

Prefill and prefill chunks: `flash_attn_varlen_func(q, k_cache, v_cache, ..., block_table=...)`,
which reads keys from the paged cache (its block size must be a multiple of 256) and aligns the
causal mask bottom-right, i.e. the new tokens sit at the end of each context. Decode:
`flash_attn_with_kvcache(q[B, 1, H, D], k_cache, v_cache, cache_seqlens=context_lens,
block_table=...)` after this step's k/v are written, so cache_seqlens already counts them.
Block tables for this backend are padded with 0 (a valid block id; never read past the length).
This module is imported only when CUDA is in use (see selector.py).
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from opentgi.models.attention.backend import write_kv_cache
from opentgi.models.attention.metadata import AttentionMetadata


class FlashAttentionBackend:
    name = "flash-attn"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        has_skips = meta.scratch.get("flash_has_skips")
        if has_skips is None:  # one device sync per step, not per layer
            has_skips = meta.scratch["flash_has_skips"] = bool((meta.slot_mapping < 0).any())
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, has_skips)
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        if meta.decode_only:
            out = flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                block_table=meta.block_tables, softmax_scale=scale, causal=True, window_size=window,
                softcap=softcap or 0.0)
            return out.squeeze(1)
        return flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
            causal=True, window_size=window, softcap=softcap or 0.0, block_table=meta.block_tables)
