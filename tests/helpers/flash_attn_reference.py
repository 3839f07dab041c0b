"""A plain-torch reference of the two flash-attn (>= 2.6) functions opentgi calls, for CPU tests.

Installed as the `flash_attn` module in tests (`sys.modules["flash_attn"] = this module`), it lets
`opentgi.models.attention.flash_backend` run on a machine without CUDA. It follows flash-attn's
documented semantics (docstrings of `flash_attn/flash_attn_interface.py`) and repeats the argument
checks of its C++ entry points (`mha_varlen_fwd`, `mha_fwd_kvcache`), so a call that the real
kernels would refuse fails here too:

- q/k/v in float16 or bfloat16, k/v in q's dtype, last dimension contiguous, head_dim <= 256,
  num_heads a multiple of num_kv_heads (GQA: query head h reads kv head h // (num_heads // kv_heads));
- cu_seqlens_*, cache_seqlens and block_table int32; block_table [batch, max_blocks] with a
  contiguous last dimension; a paged cache [num_blocks, page_block_size, kv_heads, head_dim] whose
  page_block_size is a multiple of 256;
- causal masks aligned to the bottom-right corner: query i of a sequence with seqlen_q queries and
  seqlen_k keys sees key j when j <= i + seqlen_k - seqlen_q (+ window_size[1]) and, with a window,
  j >= i + seqlen_k - seqlen_q - window_size[0]; a query row that sees no key gives zeros;
- `softcap` > 0: the scaled logits become softcap * tanh(logit / softcap) before the mask;
- each sequence's lengths must fit max_seqlen_q / max_seqlen_k (the kernels size their grid from
  them and would silently skip the rest).

Only what opentgi uses is implemented: no dropout, ALiBi, rotary, appending new k/v inside
`flash_attn_with_kvcache`, cache_batch_idx or leftpad; asking for them raises NotImplementedError.
Outputs are computed in float32 and returned in q's dtype.
"""

from __future__ import annotations

import math

import torch

__version__ = "2.6.3+reference"
PAGE_BLOCK_MULTIPLE = 256


class FlashAttnCallError(RuntimeError):
    """What flash-attn's TORCH_CHECKs would raise."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise FlashAttnCallError(message)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(q.shape[-1] == k.shape[-1] == v.shape[-1], "q, k and v must have the same head dimension")
    _check(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")
    _check(q.device == k.device == v.device, "all tensors must be on the same device")


def _check_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, batch: int) -> None:
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
           "a paged cache is [num_blocks, page_block_size, num_heads_k, head_dim]")
    _check(k_cache.shape[1] % PAGE_BLOCK_MULTIPLE == 0,
           f"Paged KV cache block size must be divisible by {PAGE_BLOCK_MULTIPLE}")
    _check(tuple(block_table.shape) == (batch, block_table.shape[1]) and block_table.dim() == 2,
           "block_table must be [batch_size, max_num_blocks_per_seq]")


def _paged_keys(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, [length, kv_heads, head_dim], through its blocks."""
    page = cache.shape[1]
    needed = -(-length // page)
    _check(needed <= table_row.shape[0], f"a sequence of {length} keys needs {needed} blocks; "
                                         f"the block table has {table_row.shape[0]}")
    blocks = table_row[:needed].long()
    _check(bool(((blocks >= 0) & (blocks < cache.shape[0])).all()),
           f"block table reads a block outside the cache: {blocks.tolist()}")
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool,
            window: tuple[int, int], softcap: float = 0.0) -> torch.Tensor:
    """q [Lq, H, D], keys/values [Lk, Hk, D] -> [Lq, H, D] in float32, flash-attn's masking."""
    lq, num_heads, _ = q.shape
    lk = keys.shape[0]
    group = num_heads // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    left, right = window
    if causal:
        right = 0
    i = torch.arange(lq, device=q.device).unsqueeze(1)
    j = torch.arange(lk, device=q.device).unsqueeze(0)
    diagonal = i + lk - lq
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
    return torch.einsum("hqk,khd->qhd", probs, values)


def _unsupported(**options) -> None:
    for name, value in options.items():
        if value:
            raise NotImplementedError(f"flash_attn_reference does not implement {name}")


def _window(window_size) -> tuple[int, int]:
    left, right = (int(x) for x in window_size)
    return left, right


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None):
    """q [total_q, H, D]; k/v [total_k, Hk, D], or with `block_table` the paged caches
    [num_blocks, page_block_size, Hk, D] where sequence b's keys are its first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] tokens through block_table[b]. Returns [total_q, H, D]."""
    _check(softcap >= 0, "softcap must be non-negative")
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes is not None,
                 return_attn_probs=return_attn_probs)
    _check_inputs(q, k, v)
    _check(q.dim() == 3, "q must be [total_q, num_heads, head_dim]")
    _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    _check(cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous(), "cu_seqlens must be contiguous")
    batch = cu_seqlens_q.numel() - 1
    _check(batch > 0, "batch size must be positive")
    _check(cu_seqlens_k.numel() == batch + 1, "cu_seqlens_k must be [batch_size + 1]")
    paged = block_table is not None
    if paged:
        _check_paged(k, v, block_table, batch)
    else:
        _check(k.dim() == 3 and k.shape == v.shape, "k/v must be [total_k, num_heads_k, head_dim]")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _check(cu_q[0] == 0 and cu_k[0] == 0, "cu_seqlens must start at 0")
    _check(cu_q[-1] == q.shape[0], f"cu_seqlens_q ends at {cu_q[-1]} but q has {q.shape[0]} tokens")
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(batch):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        _check(0 <= lq <= max_seqlen_q, f"sequence {b} has {lq} queries, past max_seqlen_q={max_seqlen_q}")
        _check(0 <= lk <= max_seqlen_k, f"sequence {b} has {lk} keys, past max_seqlen_k={max_seqlen_k}")
        if lq == 0 or lk == 0:
            continue
        if paged:
            keys, values = _paged_keys(k, block_table[b], lk), _paged_keys(v, block_table[b], lk)
        else:
            _check(cu_k[b + 1] <= k.shape[0], "cu_seqlens_k runs past k")
            keys, values = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        out[cu_q[b]:cu_q[b + 1]] = _attend(q[cu_q[b]:cu_q[b + 1]], keys, values, scale, causal,
                                           _window(window_size), softcap)
    return out.to(q.dtype)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """q [B, seqlen_q, H, D]; k_cache/v_cache [B, seqlen_cache, Hk, D], or with `block_table` the
    paged caches [num_blocks, page_block_size, Hk, D]; sequence b attends over its first
    cache_seqlens[b] cached keys. Returns [B, seqlen_q, H, D]."""
    _unsupported(k=k is not None, v=v is not None, rotary_cos=rotary_cos is not None,
                 rotary_sin=rotary_sin is not None, cache_batch_idx=cache_batch_idx is not None,
                 cache_leftpad=cache_leftpad is not None,
                 alibi_slopes=alibi_slopes is not None, return_softmax_lse=return_softmax_lse)
    _check_inputs(q, k_cache, v_cache)
    _check(q.dim() == 4, "q must be [batch_size, seqlen_q, num_heads, head_dim]")
    batch = q.shape[0]
    paged = block_table is not None
    if paged:
        _check_paged(k_cache, v_cache, block_table, batch)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        _check(k_cache.shape[0] == batch, "k_cache must be [batch_size, seqlen_cache, num_heads_k, head_dim]")
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        _check(cache_seqlens.dtype == torch.int32, "cache_seqlens must have dtype int32")
        _check(tuple(cache_seqlens.shape) == (batch,), "cache_seqlens must be [batch_size]")
        lengths = cache_seqlens.tolist()
    _check(softcap >= 0, "softcap must be non-negative")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, lk in enumerate(lengths):
        _check(0 <= lk <= capacity, f"cache_seqlens[{b}]={lk} is past the cache ({capacity} slots)")
        if lk == 0:
            continue
        if paged:
            keys, values = _paged_keys(k_cache, block_table[b], lk), _paged_keys(v_cache, block_table[b], lk)
        else:
            keys, values = k_cache[b, :lk], v_cache[b, :lk]
        out[b] = _attend(q[b], keys, values, scale, causal, _window(window_size), softcap)
    return out.to(q.dtype)
