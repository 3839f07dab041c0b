"""The CPU reference attention backend: paged KV through block tables, plain torch ops.

`torch_plan.py` plans each step once (which rows are attended in which form); this module runs
the plan layer by layer, with `scaled_dot_product_attention`, or `softcap.py` for soft-capped
logits (Gemma 2), where sdpa would be. Decode groups attend their keys gathered in whole blocks
on a transposed view, the query heads of one kv head laid along the query axis (grouped-query
attention without repeating keys).

**Batch invariance** (`batch_invariant`, the default; docs/determinism.md): one sdpa call over
many query rows computes some rows differently from the same rows one by one, and a causal call
over a whole prompt differs from the same prompt in chunks or after a cached prefix. The decode
row's form is invariant: one query token per batch entry, its keys in whole blocks padded with
masked ones; a token gets the same bits whatever the padding, the entries beside it, and the
step. So every token is attended in that form, rows of several tokens token by token in segments
that share one gather of their keys; a token's keys and their order are then the same however
its prompt was split. Its cost is in docs/benchmarks.md.

**Prompt tokens** (`prompt_form`, set where the start-up probe `prompt_form_invariant` passes)
take a faster batch-invariant form: a segment's query rows on ONE batch entry's query axis,
padded to whole `ROW_BLOCK`s, each row masked to its own context (torch_plan.py). A partial block
of rows, or more rows than sdpa attends in one block, breaks invariance, hence the padding and
`PROMPT_ROWS`. Generated tokens keep the decode row's form, so a token's form follows its kind and
the prefix cache serves only prompt blocks to prompts (docs/determinism.md).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from opentgi.models.attention import torch_plan
from opentgi.models.attention.backend import write_kv_cache
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.softcap import softcapped_attention
from opentgi.models.attention.torch_plan import Plan, Segment, make_plan

# Soft-capped decode groups of at most this many key rows (rows x padded keys) gather their keys and
# values per (row, kv head) position, contiguous for the matmuls, rather than in whole blocks and
# then a transposing copy: the same bits. Below this size the per-position gather is faster; above
# it whole blocks gather faster (docs/benchmarks.md).
HEAD_MAJOR_MAX_KEYS = 1024


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention`, or with `softcap` (Gemma 2) `softcapped_attention`."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    if is_causal:  # top-left aligned, as sdpa's is_causal
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_()
    # on every thread: bfloat16 matmuls gain from a second thread (docs/benchmarks.md)
    return softcapped_attention(q, k, v, mask, scale, softcap)


def _as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """This step's keys or values as the cache holds them (rounded to its dtype: --kv-cache-dtype),
    in x's dtype: the forms that attend them without reading the cache see the bits the others
    read, so a token's numbers do not depend on its form (models/base.py)."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], slots int64 [N] -> [N, H, D] (one row copy per slot)."""
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    return flat.index_select(0, slots)


@contextlib.contextmanager
def one_thread(on: bool):
    """The attention calls on one thread: float32's batch invariance (module docstring)."""
    threads = torch.get_num_threads() if on else 1
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class TorchAttentionBackend:
    name = "torch"
    batch_invariant = False  # set by the model (PagedDecoder.materialize); module docstring
    prompt_form = False  # prompt tokens in their own form (module docstring); set by the model

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        plan_key = ("torch", sliding_window, q.dtype, group)
        plan = meta.scratch.get(plan_key)
        if plan is None:
            plan = meta.scratch[plan_key] = make_plan(meta, k_cache.shape[1], sliding_window, q.dtype, group,
                                                       self.batch_invariant, self.prompt_form)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_skips)
        if plan.tails is not None:  # zeros, so that masked keys are finite (-inf + nan is nan)
            k_cache.view(-1, *k_cache.shape[2:]).index_fill_(0, plan.tails, 0)
            v_cache.view(-1, *v_cache.shape[2:]).index_fill_(0, plan.tails, 0)
        with one_thread(self.batch_invariant and q.dtype == torch.float32):
            return self._attend_plan(q, k, v, k_cache, v_cache, plan, scale, group, softcap)

    def _attend_plan(self, q, k, v, k_cache, v_cache, plan: Plan, scale: float, group: int,
                     softcap: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The plan's rows into `out` (a new tensor when None; native_backend.py passes the one
        holding its rows already)."""
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        num_blocks, block_size, _, head_dim = k_cache.shape
        if plan.decode:
            # [Nd, kv_heads, group, D]: the query heads sharing one kv head act as a query axis.
            q_dec = q if plan.decode_in_order else q.index_select(0, plan.decode_tokens)
            q_dec = q_dec.view(-1, num_kv_heads, group, head_dim)
            outs, first = [], 0
            for dec in plan.decode:
                rows = dec.end - dec.start
                blocks = plan.decode_blocks[first:first + rows * dec.num_blocks]
                first += rows * dec.num_blocks
                # whole blocks (block_size * kv_heads * D values a row), a group at a time so that
                # attention reads them while they are still in cache; [rows, kv_heads, L, D] views
                shape = (rows, dec.num_blocks * block_size, num_kv_heads, head_dim)
                if softcap is None or rows * shape[1] > HEAD_MAJOR_MAX_KEYS:
                    keys = k_cache.view(num_blocks, -1).index_select(0, blocks).view(shape).transpose(1, 2)
                    values = v_cache.view(num_blocks, -1).index_select(0, blocks).view(shape).transpose(1, 2)
                else:  # the soft-capped form's matmuls want each (row, kv head)'s keys contiguous:
                    # gathered so, the same values in the same layout as the transposing copy it saves
                    index = plan.head_index.get(dec.start)
                    if index is None:
                        index = plan.head_index[dec.start] = torch_plan.head_major_index(blocks, rows, block_size,
                                                                               num_kv_heads)
                    head_major = (rows, num_kv_heads, dec.num_blocks * block_size, head_dim)
                    keys = k_cache.view(-1, head_dim).index_select(0, index).view(head_major)
                    values = v_cache.view(-1, head_dim).index_select(0, index).view(head_major)
                outs.append(_attend(q_dec[dec.start:dec.end], keys.to(q.dtype), values.to(q.dtype), dec.mask,
                                    scale, softcap))
            o_dec = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(-1, num_heads, head_dim)
            if plan.decode_in_order and out is None:
                out = o_dec
            else:
                out = torch.empty_like(q) if out is None else out
                out.index_copy_(0, plan.decode_tokens, o_dec)
        if out is None:
            out = torch.empty_like(q)
        for seg in plan.segments:
            out[seg.start:seg.end] = self._segment(q, k_cache, v_cache, seg, scale, softcap)
        for seg in plan.prompt_segments:
            mask = seg.mask(seg.blocks.shape[0] * block_size, q.dtype)
            out[seg.start:seg.end] = _prompt_segment(q[seg.start:seg.end], k_cache, v_cache, seg.blocks, mask, scale,
                                                      softcap)
        for batch in plan.prompts:
            rows, length = batch.rows, batch.length
            q_b = q.index_select(0, batch.gather).view(rows, length, num_kv_heads, group, head_dim)
            q_b = q_b.permute(0, 2, 3, 1, 4).reshape(rows, num_kv_heads, group * length, head_dim)
            keys = _as_stored(k.index_select(0, batch.gather), k_cache).view(rows, length, num_kv_heads, head_dim)
            values = _as_stored(v.index_select(0, batch.gather), v_cache).view(rows, length, num_kv_heads, head_dim)
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
            o = _attend(q_b, keys, values, batch.mask, scale, softcap)
            o = o.view(rows, num_kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
            out.index_copy_(0, batch.dest, o.reshape(rows * length, num_heads, head_dim).index_select(0, batch.valid))
        for row in plan.prefill:
            q_row = q[row.q_start:row.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if row.slots is None:
                keys = _as_stored(k[row.q_start:row.q_end], k_cache)
                values = _as_stored(v[row.q_start:row.q_end], v_cache)
            else:
                keys = _gather(k_cache, row.slots).to(q.dtype)
                values = _gather(v_cache, row.slots).to(q.dtype)
            keys = keys.transpose(0, 1).unsqueeze(0)
            values = values.transpose(0, 1).unsqueeze(0)
            o = _attend(q_row, keys, values, row.mask, scale, softcap, is_causal=row.mask is None,
                        enable_gqa=group > 1)
            out[row.q_start:row.q_end] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _segment(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: Segment,
                 scale: float, softcap: float | None) -> torch.Tensor:
        """A segment's tokens, each attended as a decode row: one query token per batch entry, the
        sequence's keys gathered once and shared (stride 0) by the entries."""
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        n, num_heads = seg.end - seg.start, q.shape[1]
        shape = (1, seg.blocks.shape[0] * block_size, num_kv_heads, head_dim)
        keys = k_cache.view(num_blocks, -1).index_select(0, seg.blocks).view(shape).transpose(1, 2)
        values = v_cache.view(num_blocks, -1).index_select(0, seg.blocks).view(shape).transpose(1, 2)
        keys = keys.to(q.dtype).expand(n, -1, -1, -1)
        values = values.to(q.dtype).expand(n, -1, -1, -1)
        q_seg = q[seg.start:seg.end].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        return _attend(q_seg, keys, values, seg.mask, scale, softcap).reshape(n, num_heads, head_dim)


def _prompt_segment(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                    mask: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """A prompt segment (module docstring): q [n, H, D] -> [n, H, D], its rows (token, query head of
    a kv head) on one batch entry's query axis, padded to the mask's rows with the last one."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    n, num_heads = q.shape[0], q.shape[1]
    group = num_heads // num_kv_heads
    rows, padded = n * group, mask.shape[-2]
    shape = (1, blocks.shape[0] * block_size, num_kv_heads, head_dim)
    keys = k_cache.view(num_blocks, -1).index_select(0, blocks).view(shape).transpose(1, 2).to(q.dtype)
    values = v_cache.view(num_blocks, -1).index_select(0, blocks).view(shape).transpose(1, 2).to(q.dtype)
    q_rows = q.view(n, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv_heads, rows, head_dim)
    if padded > rows:
        q_rows = torch.cat([q_rows, q_rows[:, :, -1:].expand(1, num_kv_heads, padded - rows, head_dim)], dim=2)
    if softcap is None:
        o = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=scale)
    else:
        o = softcapped_attention(q_rows, keys, values, mask, scale, softcap)
    o = o[0, :, :rows].reshape(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3)
    return o.reshape(n, num_heads, head_dim)


_PROBE_CACHE: dict[tuple, bool] = {}


def prompt_form_invariant(num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                          block_size: int = 16, softcap: float | None = None) -> bool:
    """Whether the prompt form gives random tokens the same bits in segments of several sizes and
    offsets, with extra key padding, as each token alone (module docstring); probed once per shape
    (and soft-capping: then `softcapped_attention` instead of sdpa)."""
    key = (num_kv_heads, group, head_dim, dtype, block_size, torch.get_num_threads(), softcap)
    if key in _PROBE_CACHE:
        return _PROBE_CACHE[key]
    gen = torch.Generator().manual_seed(0)
    total = 600  # past 512 keys, where sdpa cuts the keys in blocks
    num_blocks = -(-total // block_size) + 4
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(total, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    table = torch.arange(num_blocks).unsqueeze(0)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), cu_seqlens_q=torch.zeros(2, dtype=torch.int32),
                             cu_seqlens_k=torch.zeros(2, dtype=torch.int32), max_seqlen_q=0, max_seqlen_k=0,
                             context_lens=torch.zeros(1, dtype=torch.int32), block_tables=table, decode_only=False)
    scale = head_dim ** -0.5

    def attend(start: int, count: int, extra_blocks: int = 0) -> torch.Tensor:
        outs = []
        for seg in torch_plan.cut_into_prompt_segments(meta, 0, start, count, start + count, block_size, None, group):
            blocks = torch.cat([seg.blocks, torch.arange(num_blocks - extra_blocks, num_blocks)])
            mask = seg.mask(blocks.shape[0] * block_size, dtype)  # the extra blocks lie past every token's keys
            outs.append(_prompt_segment(q[seg.start:seg.end], k_cache, v_cache, blocks, mask, scale, softcap))
        return torch.cat(outs)

    with torch.inference_mode(), one_thread(dtype == torch.float32):  # as the backend attends
        per_segment = max(1, torch_plan.PROMPT_ROWS // group)
        ok = True
        for start, count, extra in ((0, per_segment, 0), (7, 2 * per_segment + 5, 2), (520, 41, 4), (300, 3, 0)):
            together = attend(start, count, extra)
            for t in range(count):
                if not torch.equal(attend(start + t, 1), together[t:t + 1]):
                    ok = False
    _PROBE_CACHE[key] = ok
    return ok
