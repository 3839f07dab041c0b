"""The CPU reference attention backend: paged KV through block tables, plain torch ops.

Decode rows (one new token) of a step are attended together: their keys are gathered through the
block tables into one [B, kv_heads, L, head_dim] tensor, masked by context length, and attended by
a single `scaled_dot_product_attention`, with the query heads of one kv head laid along the query
axis (grouped-query attention without repeating keys). Rows with several new tokens (prefill,
prefill chunks) are attended one sequence at a time with a causal mask offset by the cached length.
What depends only on the step (block ids, masks) is computed once and kept in `meta.scratch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opentgi.models.attention.backend import write_kv_cache
from opentgi.models.attention.metadata import AttentionMetadata


@dataclass
class _PrefillRow:
    q_start: int
    q_end: int
    context_len: int
    block_ids: torch.Tensor | None  # None: no cached prefix, attend over this step's own k/v
    mask: torch.Tensor | None  # bool [q_len, context_len]; None: plain causal


@dataclass
class _DecodeGroup:
    token_index: torch.Tensor  # int64 [Bd]: the row of each decode sequence in the flat batch
    block_ids: torch.Tensor  # int64 [Bd, nb]
    key_len: int  # nb * block_size, trimmed to the longest context
    mask: torch.Tensor | None  # additive float [Bd, 1, 1, key_len]; None: every key is visible


@dataclass
class _Plan:
    has_skips: bool
    decode: _DecodeGroup | None
    prefill: list[_PrefillRow]


def _causal_mask(q_len: int, context_len: int, window: int | None) -> torch.Tensor:
    q_pos = torch.arange(context_len - q_len, context_len).unsqueeze(1)
    k_pos = torch.arange(context_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _make_plan(meta: AttentionMetadata, block_size: int, window: int | None) -> _Plan:
    cu_q = meta.cu_seqlens_q.tolist()
    context_lens = meta.context_lens.tolist()
    device = meta.block_tables.device
    decode_seqs, prefill = [], []
    for b, ctx in enumerate(context_lens):
        q_len = cu_q[b + 1] - cu_q[b]
        if q_len == 0:
            continue
        if q_len == 1:
            decode_seqs.append(b)
            continue
        limited = window is not None and window < ctx
        if ctx == q_len and not limited:
            prefill.append(_PrefillRow(cu_q[b], cu_q[b + 1], ctx, None, None))
            continue
        num_blocks = -(-ctx // block_size)
        block_ids = meta.block_tables[b, :num_blocks].long()
        prefill.append(_PrefillRow(cu_q[b], cu_q[b + 1], ctx, block_ids,
                                   _causal_mask(q_len, ctx, window).to(device)))
    decode = None
    if decode_seqs:
        ctx = meta.context_lens[decode_seqs].long().to(device)
        max_ctx = max(context_lens[b] for b in decode_seqs)
        num_blocks = -(-max_ctx // block_size)
        block_ids = meta.block_tables[decode_seqs, :num_blocks].long().clamp_(min=0)
        key_len = min(num_blocks * block_size, max_ctx)
        k_pos = torch.arange(key_len, device=device).unsqueeze(0)
        visible = k_pos < ctx.unsqueeze(1)
        if window is not None:
            visible &= k_pos > ctx.unsqueeze(1) - 1 - window
        mask = None
        if not bool(visible.all()):  # one additive mask per step, not a bool->float per layer
            mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
            mask = mask[:, None, None, :]
        token_index = torch.tensor([cu_q[b] for b in decode_seqs], dtype=torch.long, device=device)
        decode = _DecodeGroup(token_index, block_ids, key_len, mask)
    has_skips = bool((meta.slot_mapping < 0).any()) if meta.slot_mapping.numel() else False
    return _Plan(has_skips, decode, prefill)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_ids [..., nb] -> [..., length, H, D]."""
    gathered = cache[block_ids]  # [..., nb, block_size, H, D]
    shape = gathered.shape
    return gathered.reshape(*shape[:-4], shape[-4] * shape[-3], *shape[-2:])[..., :length, :, :]


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        plan_key = ("torch", sliding_window)
        plan = meta.scratch.get(plan_key)
        if plan is None:
            plan = meta.scratch[plan_key] = _make_plan(meta, k_cache.shape[1], sliding_window)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_skips)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        if plan.decode is not None:
            dec = plan.decode
            num_seqs, head_dim = dec.token_index.shape[0], q.shape[2]
            # [Bd, kv_heads, group, D]: the query heads sharing one kv head act as a query axis.
            q_dec = q.index_select(0, dec.token_index).view(num_seqs, num_kv_heads, group, head_dim)
            keys = _gather(k_cache, dec.block_ids, dec.key_len).transpose(1, 2)
            values = _gather(v_cache, dec.block_ids, dec.key_len).transpose(1, 2)
            mask = None if dec.mask is None else dec.mask.to(q.dtype)
            o = F.scaled_dot_product_attention(q_dec, keys.to(q.dtype), values.to(q.dtype),
                                               attn_mask=mask, scale=scale)
            out.index_copy_(0, dec.token_index, o.reshape(num_seqs, num_heads, head_dim))
        for row in plan.prefill:
            q_row = q[row.q_start:row.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if row.block_ids is None:
                keys, values = k[row.q_start:row.q_end], v[row.q_start:row.q_end]
            else:
                keys = _gather(k_cache, row.block_ids, row.context_len).to(q.dtype)
                values = _gather(v_cache, row.block_ids, row.context_len).to(q.dtype)
            keys = keys.transpose(0, 1).unsqueeze(0)
            values = values.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q_row, keys, values, attn_mask=row.mask,
                                               is_causal=row.mask is None, scale=scale,
                                               enable_gqa=group > 1)
            out[row.q_start:row.q_end] = o.squeeze(0).transpose(0, 1)
        return out
