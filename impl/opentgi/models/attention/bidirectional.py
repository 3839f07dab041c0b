"""Image tokens that attend each other both ways (Gemma 3, as transformers masks them): a prompt's
image token sees the keys before it (within the layer's window) and every key of its own image,
the later ones too. The attention backends are causal; after the backend has written the step's
keys and values to the cache and attended every row causally, each image row of the step is
attended again here against its sequence's keys up to its image's end, and replaces the causal
row. The model runner keeps an image within one step (a prefill chunk never ends inside it), so
those keys are all in the cache.

Each row is attended alone (one query row against its own keys, on one thread in float32), so its
numbers depend only on its keys: the same alone, batched, in any chunk and after a prefix-cache hit
(docs/determinism.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.torch_backend import one_thread


def attend_image_spans(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, window: int | None, batch_invariant: bool) -> torch.Tensor:
    """out, q [T, heads, D]; caches [blocks, block size, kv heads, D] holding the step's keys ->
    `out` with the rows of `meta.image_spans` attended both ways within their image."""
    block_size = k_cache.shape[1]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    with one_thread(batch_invariant and q.dtype == torch.float32):
        for row, b, first, last, lo, hi in meta.image_spans:
            positions = torch.arange(hi, device=q.device)
            blocks = meta.block_tables[b, :-(-hi // block_size)].to(torch.int64)
            slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size, device=q.device)).flatten()[:hi]
            keys = flat_k.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kv heads, hi, D]
            values = flat_v.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            in_image = positions >= lo
            for p in range(first, last):
                visible = (positions <= p) | in_image
                if window is not None:
                    visible &= (positions > p - window) | in_image
                query = q[row + p - first].unsqueeze(0).unsqueeze(2)  # [1, heads, 1, D]
                o = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible.view(1, 1, 1, -1),
                                                   scale=scale, enable_gqa=True)
                out[row + p - first] = o[0, :, 0].to(out.dtype)
    return out
