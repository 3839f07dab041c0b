"""The CPU reference attention backend: paged KV through block tables, plain torch ops.

Decode rows (one new token) of a step are attended in groups of similar context length (sorted,
cut where the modelled cost, a fixed cost per group plus the padded key rows attended, is least;
`_decode_groups`): a group's keys are gathered
block by block (one `index_select` of whole blocks on the [num_blocks, block_size * kv_heads *
head_dim] view of the cache) into [B, L, kv_heads, head_dim] (L: the group's longest context
rounded up to whole blocks), masked by context length, and attended by a single
`scaled_dot_product_attention` on a transposed view, with the query heads of one kv head laid along
the query axis (grouped-query attention without repeating keys).
Fresh prompts (no cached prefix) of at most `MAX_BATCHED_PROMPT` tokens are attended together in
batches of similar length (`_PromptBatch`): gathered into [rows, length] padded to the longest, the
query heads of one kv head laid along the query axis as for decode, one causal and padding mask,
one `scaled_dot_product_attention` call per batch instead of one per prompt (a wave of 64 short
prompts: 1.2 ms a layer instead of 2.0, the same numbers). Other rows with several new tokens
(prefill chunks, prompts after a cached prefix, long prompts) are attended one sequence at a time
with a causal mask offset by the cached length; a row of at most `MAX_TOKENWISE_QUERY` new tokens after
cached ones (speculative decoding's verify rows) is attended token by token like lone decode rows,
so that its bfloat16 output is bit for bit what decoding those tokens one per step gives. What
depends only on the step (slot indices, masks) is computed once and kept in `meta.scratch`.

**Batch invariance** (`batch_invariant`, the default; docs/determinism.md): the paths above give a
token different bits depending on its neighbours. Measured on an AMD EPYC (bfloat16, SmolLM2's
shapes): one `scaled_dot_product_attention` over many query rows computes some rows differently
from the same rows one by one (12 of 96 query tokens of one prompt, more for longer prompts), and
a causal call over a whole prompt differs from the same prompt in chunks, after a cached prefix, or
from a call over a longer prompt. What was measured invariant is the decode row's form: one query
token per batch entry (its query heads along the query axis), its keys in whole blocks padded with
masked ones: a token gets the same bits whatever the padding (up to 1,000 extra keys tried), the
batch entries beside it, and the step. So with batch invariance every token is attended in that
form: decode rows as above, and every row of several tokens (a prompt, a prefill chunk, a tail
after a prefix-cache hit, a verify row) token by token, in segments of `SEGMENT_TOKENS` tokens of
one sequence that share one gather of its keys (a stride-0 view, no copy per token). A token's
keys and their order are then the same however its prompt was split. The cost: prompt attention
does the work of a decode row per token, and no causal skipping inside a segment (docs/benchmarks.md).

**Prompt tokens** (`prompt_form`, set where the start-up probe `prompt_form_invariant` passes;
the metadata's `prompt_new_tokens` says which new tokens are prompt tokens) take another
batch-invariant form, 3x faster: up to `PROMPT_ROWS` query rows of one sequence (its tokens times
the query heads of a kv head) on the query axis of ONE batch entry, padded (the last row repeated)
to a whole number of `ROW_BLOCK` rows, each row masked to its own context, keys in whole blocks.
Measured (bfloat16, SmolLM2's shapes, 1 and 2 threads): a token's output is then the same for
every segment it sits in (1 to 53 tokens, any offset) and any key padding (0 to 512 extra keys);
with a partial block of rows, or more than 191 rows (sdpa then cuts the queries in blocks of 64),
some rows differ. A 1,000-token prompt's attention: 42 ms a layer against 125 in the decode row's
form (1 thread; one causal call: 37). Generated tokens keep the decode row's form, so a token's
form follows its kind and the prefix cache serves only prompt blocks to prompts
(docs/determinism.md).

**Soft-capped logits** (Gemma 2) take every one of these forms, with `_softcapped` (two matmuls
around the capped softmax, keys and values met in fixed chunks) where sdpa would be; the probe
then checks the prompt form with soft-capping.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from opentgi.models.attention.backend import write_kv_cache
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.layers.elementwise import elementwise_on_padded_copy

# A decode group's fixed cost (one scaled_dot_product_attention call and two block gathers per
# layer) in key rows (one row's one key): SmolLM2-135M's shapes (9 heads, 3 kv heads, head_dim 64),
# bf16, 2 threads: ~25-30 us a call against ~0.03 us a key row.
GROUP_COST_KEYS = 1000
MAX_TOKENWISE_QUERY = 16
MAX_BATCHED_PROMPT = 128  # fresh prompts up to this many tokens are attended in padded batches
SEGMENT_TOKENS = 64  # batch invariance: tokens of one sequence attended per call, sharing one key gather
ROW_BLOCK = 32  # prompt form: query rows padded to whole blocks of this many (sdpa's for < 192 rows)
PROMPT_ROWS = 160  # prompt form: the most query rows a call (under 192, where sdpa cuts in 64s)
SOFTCAP_KEY_CHUNK = 128  # soft-capped attention in float32: keys per matmul of the probabilities and values
# soft-capped attention in bfloat16: keys per matmul of the probabilities and values (oneDNN's
# bfloat16 `bmm` reduces up to 1,024 keys alike whatever their zero padding: tests/models/test_softcap_attention.py)
SOFTCAP_BF16_KEY_CHUNK = 1024
# Soft-capped decode groups of at most this many key rows (rows x padded keys) gather their keys and
# values per (row, kv head) position, contiguous for the matmuls, rather than in whole blocks and
# then a transposing copy. The same bits; 1 thread, Gemma 2 at the default model's shape, a layer's
# decode attention: 186 -> 171 us at 1 row, 756 -> 688 us at 16, but 4050 -> 4264 us at 64 rows
# (~400 keys each: past L2, the many 128-byte rows gather slower than whole blocks). In the model's
# decode step on 2 threads (25 rounds in turns, medians) the cut at 1,024 key rows against 4,096:
# 1 row the same (26.51 / 26.44 ms), 16 rows 50.10 / 51.81 ms, 64 rows 143.2 / 149.4 ms.
HEAD_MAJOR_MAX_KEYS = 1024


@dataclass
class _PrefillRow:
    q_start: int
    q_end: int
    context_len: int
    slots: torch.Tensor | None  # int64 [context_len]; None: no cached prefix, attend over this step's k/v
    mask: torch.Tensor | None  # bool [q_len, context_len]; None: plain causal


@dataclass
class _DecodeGroup:
    start: int  # the group's rows are decode rows start:end of the step (in the plan's order)
    end: int
    num_blocks: int  # blocks per row: the group's longest context, rounded up to whole blocks
    mask: torch.Tensor | None  # additive [end - start, 1, 1, num_blocks * block_size]; None: all visible


@dataclass
class _PromptBatch:
    """Fresh prompts attended together, each padded to the batch's longest (`length`)."""
    rows: int
    length: int
    gather: torch.Tensor  # int64 [rows * length]: the step's token row at each padded position
    valid: torch.Tensor  # int64: the padded positions that hold real tokens
    dest: torch.Tensor  # int64: the step's token row of each of those
    mask: torch.Tensor  # additive [rows, 1, group * length, length]: causal, padding keys hidden


@dataclass
class _Segment:
    """Batch invariance: query tokens start:end of one sequence, each attended as a decode row."""
    start: int
    end: int
    blocks: torch.Tensor  # int64 [num_blocks]: the sequence's blocks up to the segment's last token
    mask: torch.Tensor | None  # additive [end - start, 1, 1, num_blocks * block_size]; None: all visible


@dataclass
class _PromptSegment:
    """Prompt tokens start:end of one sequence, their query rows on one batch entry's query axis.
    Its mask ([1, 1, padded rows, keys]: 3x the decode row form's, one per query head of a kv
    head) is built when attended, so that a long prompt's step holds one at a time."""
    start: int
    end: int
    blocks: torch.Tensor  # int64 [num_blocks]: the sequence's blocks up to the segment's last token
    last_ctx: int  # the keys of the segment's last token
    group: int  # query heads per kv head
    window: int | None

    def mask(self, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive [1, 1, padded rows, num_keys]: each row its token's keys, padding rows the last's."""
        device = self.blocks.device
        n, rows = self.end - self.start, (self.end - self.start) * self.group
        padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
        ctx_of = torch.arange(self.last_ctx - n + 1, self.last_ctx + 1, device=device).repeat_interleave(self.group)
        ctx_of = torch.cat([ctx_of, ctx_of[-1:].expand(padded - rows)]).unsqueeze(1)  # [padded, 1]
        k_pos = torch.arange(num_keys, device=device).unsqueeze(0)
        visible = k_pos < ctx_of
        if self.window is not None:
            visible &= k_pos > ctx_of - 1 - self.window
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        return mask[None, None]


@dataclass
class _Plan:
    has_skips: bool
    decode_tokens: torch.Tensor | None  # int64 [Nd]: the flat-batch row of each decode row, grouped
    decode_blocks: torch.Tensor | None  # int64: each group's rows' block ids, num_blocks per row
    decode_in_order: bool  # decode_tokens is 0..T-1: the step is all decode rows, already in group order
    tails: torch.Tensor | None  # int64: slots past the context in last blocks this step entered
    decode: list[_DecodeGroup]
    prefill: list[_PrefillRow]
    prompts: list[_PromptBatch]
    segments: list[_Segment]
    prompt_segments: list[_PromptSegment]
    # soft-capped decode groups: each group's (row, kv head, position) cache rows, built by the
    # step's first layer (`_head_major_index`)
    head_index: dict[int, torch.Tensor] = field(default_factory=dict)


def _head_major_index(blocks: torch.Tensor, rows: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """A decode group's block ids [rows * num_blocks] -> int64 [rows * kv_heads * L]: the row of
    each (row, kv head, position) in the cache viewed as [slots * kv_heads, D], so that one
    `index_select` gathers a group's keys as contiguous [rows, kv_heads, L, D]."""
    offsets = torch.arange(block_size, device=blocks.device)
    slots = (blocks.view(rows, -1, 1) * block_size + offsets).view(rows, 1, -1)  # [rows, 1, L]
    heads = torch.arange(num_kv_heads, device=blocks.device).view(1, num_kv_heads, 1)
    return (slots * num_kv_heads + heads).reshape(-1)


def _causal_mask(q_len: int, context_len: int, window: int | None) -> torch.Tensor:
    q_pos = torch.arange(context_len - q_len, context_len).unsqueeze(1)
    k_pos = torch.arange(context_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """block ids [..., nb] -> the cache slots of the first `length` positions, int64 [..., length]."""
    offsets = torch.arange(block_size, device=block_table.device)
    slots = block_table.long().clamp(min=0).unsqueeze(-1) * block_size + offsets
    return slots.flatten(-2)[..., :length]


def _decode_groups(rows: list[int], lens: list[int], block_size: int) -> list[list[int]]:
    """Rows sorted by context length (longest first), cut into groups that minimise the modelled
    attention cost of the step: GROUP_COST_KEYS per group (one attention call, two gathers) plus one
    per key row attended, each row padded to its group's longest context in whole blocks. Cuts fall
    only where the block count changes; dynamic programming over those runs. Each group lists its
    rows in their order in `rows`."""
    order = sorted(range(len(rows)), key=lambda i: -lens[i])
    blocks = [-(-lens[i] // block_size) for i in order]
    starts = [0] + [p for p in range(1, len(order)) if blocks[p] != blocks[p - 1]]
    runs = len(starts)
    starts.append(len(order))
    best = [0] + [None] * runs  # best[j]: the cost of rows order[:starts[j]] in groups
    cut = [0] * (runs + 1)
    for j in range(1, runs + 1):
        for i in range(j):
            cost = best[i] + GROUP_COST_KEYS + (starts[j] - starts[i]) * blocks[starts[i]] * block_size
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = runs
    while j > 0:
        # rows in their batch order within a group (the mask is per row): a step that is one group
        # of decode rows then needs no gather of its queries nor scatter of its outputs
        groups.append(sorted(order[starts[cut[j]]:starts[j]]))
        j = cut[j]
    return groups[::-1]


def _decode_group(meta: AttentionMetadata, rows: list[int], lens: list[int], start: int, block_size: int,
                  window: int | None, dtype: torch.dtype) -> tuple[_DecodeGroup, torch.Tensor]:
    """A group of decode rows and its rows' block ids ([len(rows) * num_blocks])."""
    device = meta.block_tables.device
    num_blocks = -(-max(lens) // block_size)
    key_len = num_blocks * block_size
    index = torch.tensor(rows, dtype=torch.long, device=device)
    table = meta.block_tables.index_select(0, index)[:, :num_blocks].long()
    # past a row's last block: its own first block again (masked), never another request's k/v
    blocks = torch.where(table >= 0, table, table[:, :1])
    ctx = torch.tensor(lens, device=device).unsqueeze(1)
    k_pos = torch.arange(key_len, device=device).unsqueeze(0)
    visible = k_pos < ctx
    if window is not None:
        visible &= k_pos > ctx - 1 - window
    mask = None
    if not bool(visible.all()):  # one additive mask per step in q's dtype, not a conversion per layer
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None, :]
    return _DecodeGroup(start, start + len(rows), num_blocks, mask), blocks.reshape(-1)


def _segments(meta: AttentionMetadata, b: int, q_start: int, q_len: int, ctx: int, block_size: int,
              window: int | None, dtype: torch.dtype) -> list[_Segment]:
    """Sequence b's q_len new tokens (flat rows q_start..), ending at context ctx, cut into segments
    of SEGMENT_TOKENS; each token's visible keys as a decode row of its position has them."""
    device = meta.block_tables.device
    out = []
    for first in range(0, q_len, SEGMENT_TOKENS):
        n = min(SEGMENT_TOKENS, q_len - first)
        last_ctx = ctx - q_len + first + n  # keys of the segment's last token
        num_blocks = -(-last_ctx // block_size)
        blocks = meta.block_tables[b, :num_blocks].long()
        ctx_of = torch.arange(last_ctx - n + 1, last_ctx + 1, device=device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(num_blocks * block_size, device=device).unsqueeze(0)
        visible = k_pos < ctx_of
        if window is not None:
            visible &= k_pos > ctx_of - 1 - window
        mask = None
        if not bool(visible.all()):
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            mask = mask[:, None, None, :]
        out.append(_Segment(q_start + first, q_start + first + n, blocks, mask))
    return out


def _prompt_segments(meta: AttentionMetadata, b: int, q_start: int, q_len: int, ctx: int, block_size: int,
                     window: int | None, group: int) -> list[_PromptSegment]:
    """Sequence b's q_len prompt tokens (flat rows q_start..), the last at context ctx, in segments
    of at most PROMPT_ROWS // group tokens (module docstring)."""
    per_segment = max(1, PROMPT_ROWS // group)
    out = []
    for first in range(0, q_len, per_segment):
        n = min(per_segment, q_len - first)
        last_ctx = ctx - q_len + first + n
        num_blocks = -(-last_ctx // block_size)
        out.append(_PromptSegment(q_start + first, q_start + first + n, meta.block_tables[b, :num_blocks].long(),
                                  last_ctx, group, window))
    return out


def _prompt_batches(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Fresh prompts' (start, end) token rows, longest first, cut into batches whose prompts are
    all longer than half the batch's longest (padding at most doubles a batch's tokens)."""
    batches: list[list[tuple[int, int]]] = []
    for span in sorted(spans, key=lambda s: s[0] - s[1]):
        if batches and span[1] - span[0] > (batches[-1][0][1] - batches[-1][0][0]) // 2:
            batches[-1].append(span)
        else:
            batches.append([span])
    return batches


def _prompt_batch(spans: list[tuple[int, int]], group: int, dtype: torch.dtype,
                  device: torch.device) -> _PromptBatch:
    starts = torch.tensor([start for start, _ in spans], device=device)
    lens = torch.tensor([end - start for start, end in spans], device=device)
    length = int(lens.max())
    pos = torch.arange(length, device=device)
    real = pos.unsqueeze(0) < lens.unsqueeze(1)  # [rows, length]: a real token, not padding
    # padding repeats the row's first token (a real one, hidden from every query as a key)
    gather = (starts.unsqueeze(1) + torch.where(real, pos, 0)).reshape(-1)
    valid = real.reshape(-1).nonzero().squeeze(1)
    visible = (pos.unsqueeze(0) <= pos.unsqueeze(1)).unsqueeze(0) & real.unsqueeze(1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    # query rows ordered (query head within the kv head, position), as the queries are laid out
    mask = mask.unsqueeze(1).expand(-1, group, -1, -1).reshape(len(spans), 1, group * length, length)
    return _PromptBatch(len(spans), length, gather, valid, gather.index_select(0, valid), mask)


def _make_plan(meta: AttentionMetadata, block_size: int, window: int | None, dtype: torch.dtype,
               heads_per_kv: int, batch_invariant: bool = False, prompt_form: bool = False) -> _Plan:
    cu_q = meta.cu_seqlens_q.tolist()
    context_lens = meta.context_lens.tolist()
    device = meta.block_tables.device
    decode_seqs, prefill, fresh = [], [], []
    # decode work as (sequence rows, context lengths, flat-batch token rows) per group
    groups: list[tuple[list[int], list[int], list[int]]] = []
    tails: list[int] = []
    segments: list[_Segment] = []
    prompt_segments: list[_PromptSegment] = []
    prompt_new = meta.prompt_new_tokens if batch_invariant and prompt_form else None
    for b, ctx in enumerate(context_lens):
        q_len = cu_q[b + 1] - cu_q[b]
        if q_len == 0:
            continue
        last_block_start = (ctx - 1) // block_size * block_size
        if ctx % block_size and ctx - q_len <= last_block_start:
            # this step wrote the first token of the sequence's last block: the rest of the block
            # still holds whatever its previous owner left (decode attends whole blocks, masked)
            first = int(meta.block_tables[b, ctx // block_size]) * block_size
            tails += range(first + ctx % block_size, first + block_size)
        num_prompt = prompt_new[b] if prompt_new is not None else 0
        if num_prompt:  # prompt tokens first (their own form), then any generated ones
            prompt_segments += _prompt_segments(meta, b, cu_q[b], num_prompt, ctx - q_len + num_prompt,
                                                block_size, window, heads_per_kv)
            if num_prompt < q_len:
                segments += _segments(meta, b, cu_q[b] + num_prompt, q_len - num_prompt, ctx, block_size,
                                      window, dtype)
            continue
        if q_len == 1:
            decode_seqs.append(b)
            continue
        if batch_invariant:
            segments += _segments(meta, b, cu_q[b], q_len, ctx, block_size, window, dtype)
            continue
        if q_len <= MAX_TOKENWISE_QUERY and ctx > q_len:
            # a few new tokens after cached ones (speculative decoding's last token + drafts): each
            # attended as if decoded alone, so its output is bit for bit that of plain decoding
            for j in range(q_len):
                groups.append(([b], [ctx - q_len + 1 + j], [cu_q[b] + j]))
            continue
        limited = window is not None and window < ctx
        if ctx == q_len and not limited:
            if q_len <= MAX_BATCHED_PROMPT:
                fresh.append((cu_q[b], cu_q[b + 1]))
            else:
                prefill.append(_PrefillRow(cu_q[b], cu_q[b + 1], ctx, None, None))
            continue
        num_blocks = -(-ctx // block_size)
        slots = _slots(meta.block_tables[b, :num_blocks], ctx, block_size)
        prefill.append(_PrefillRow(cu_q[b], cu_q[b + 1], ctx, slots,
                                   _causal_mask(q_len, ctx, window).to(device)))
    if decode_seqs:
        lens = [context_lens[b] for b in decode_seqs]
        for group in _decode_groups(decode_seqs, lens, block_size):
            seqs = [decode_seqs[i] for i in group]
            groups.append((seqs, [lens[i] for i in group], [cu_q[b] for b in seqs]))
    decode, blocks, tokens, start = [], [], [], 0
    for seqs, lens, rows in groups:
        group, group_blocks = _decode_group(meta, seqs, lens, start, block_size, window, dtype)
        decode.append(group)
        blocks.append(group_blocks)
        tokens += rows
        start = group.end
    decode_tokens = torch.tensor(tokens, dtype=torch.long, device=device) if tokens else None
    decode_blocks = torch.cat(blocks) if blocks else None
    has_skips = bool((meta.slot_mapping < 0).any()) if meta.slot_mapping.numel() else False
    decode_in_order = tokens == list(range(cu_q[-1]))
    tail_slots = torch.tensor(tails, dtype=torch.long, device=device) if tails else None
    prompts = []
    for spans in _prompt_batches(fresh):
        if len(spans) == 1:  # alone: attended as is, no padding
            prefill.append(_PrefillRow(spans[0][0], spans[0][1], spans[0][1] - spans[0][0], None, None))
        else:
            prompts.append(_prompt_batch(spans, heads_per_kv, dtype, device))
    return _Plan(has_skips, decode_tokens, decode_blocks, decode_in_order, tail_slots, decode, prefill,
                 prompts, segments, prompt_segments)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention`, or with `softcap` (Gemma 2) `_softcapped`."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    if is_causal:  # top-left aligned, as sdpa's is_causal
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_()
    # on every thread: decode rows ran on one alone while their values went through float32
    # (docs/benchmarks.md); in bfloat16 matmuls a second thread pays (Gemma 2's decode step, 2
    # threads against 1 for these calls: c=16 0.87x, c=64 0.88x the time, c=1 the same)
    return _softcapped(q, k, v, mask, scale, softcap)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                cap: float) -> torch.Tensor:
    """Attention whose logits are soft-capped, cap * tanh(s * scale / cap), before the mask and the
    softmax (Gemma 2), which sdpa cannot do. q [..., n, D], k and v [..., L, D] (the same leading
    dims, any strides); mask additive or bool, broadcast to [..., n, L].

    The capped logits (`_capped_logits`) go through a float32 softmax (as transformers'). In
    bfloat16 the probabilities, rounded to bfloat16 as sdpa rounds them, times the values go
    through oneDNN's bfloat16 `bmm` over at most `SOFTCAP_BF16_KEY_CHUNK` keys a matmul (float32
    sums of the chunks' products, in order): its reduction gives a row the same bits for every key
    count up to 1,024 (a row over 700 keys alone and padded to 1040 did not), so a row's bits depend
    neither on the rows beside it nor on its masked key padding (tests/models/test_softcap_attention.py).
    Against the float32 form below, the same error against a float64 reference and 1.5-3x faster
    for decode groups of 5-16 rows (1 thread; one row: the same). In other dtypes, the products in
    float32 (the values converted as they are padded), in matmuls over exactly `SOFTCAP_KEY_CHUNK`
    keys (zero padded), summed in order: float32's reduction was cut differently with the key count
    (a row over 130 keys alone and padded to 512 gave other bits). Measured no
    faster (1 thread, decode groups of 1-16 rows): giving the capped logits to sdpa as its mask
    with a zero query (165-1120 us a group against 210-1035 here; sdpa's prompt form with head dims
    of 128 and 256 is not batch invariant either), and a decode row's q.k as one matmul against
    all its kv heads' keys (no copy of the keys, but three times the products: faster for one row
    only)."""
    *lead, n, d = q.shape
    keys, batch = k.shape[-2], q.numel() // (n * d)
    p = torch.softmax(_capped_logits(q, k, mask, scale, cap), dim=-1).reshape(batch, n, keys)
    if v.dtype == torch.bfloat16:
        return _bf16_probs_times_values(p, v.reshape(batch, keys, d)).view(*lead, n, d)
    chunk = SOFTCAP_KEY_CHUNK
    padded = -(-keys // chunk) * chunk
    # the values in float32 and the probabilities, zero padded to whole chunks: each written once
    # (a zero-filled buffer, or F.pad, writes the whole of it twice: ~4% of a decode group's call)
    vp = torch.empty(batch, padded, d, dtype=torch.float32, device=v.device)
    vp.view(*lead, padded, d)[..., :keys, :].copy_(v)  # any strides (a stride-0 expand too), to float32
    if padded != keys:
        vp[:, keys:].zero_()
        p_padded = torch.empty(batch, n, padded, dtype=p.dtype, device=p.device)
        p_padded[..., :keys].copy_(p)
        p = p_padded
        p[..., keys:].zero_()
    chunks = padded // chunk
    if chunks == 1:
        return torch.bmm(p, vp).view(*lead, n, d).to(q.dtype)
    # [batch * chunks, n, chunk] @ [batch * chunks, chunk, d], the chunks' products summed in order
    parts = torch.bmm(p.view(batch, n, chunks, chunk).transpose(1, 2).reshape(-1, n, chunk),
                      vp.view(-1, chunk, d)).view(batch, chunks, n, d)
    out = parts[:, 0].clone()
    for i in range(1, chunks):
        out += parts[:, i]
    return out.view(*lead, n, d).to(q.dtype)


def _bf16_probs_times_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 probabilities [B, n, L] times bfloat16 values [B, L, D] -> bfloat16 [B, n, D], in
    bfloat16 matmuls over at most SOFTCAP_BF16_KEY_CHUNK keys, their products summed in float32 in
    order (`_softcapped`)."""
    p = p.to(torch.bfloat16)
    keys, chunk = p.shape[-1], SOFTCAP_BF16_KEY_CHUNK
    if keys <= chunk:
        return torch.bmm(p, v)
    out = torch.bmm(p[..., :chunk], v[:, :chunk]).float()
    for start in range(chunk, keys, chunk):
        out += torch.bmm(p[..., start:start + chunk], v[:, start:start + chunk])
    return out.to(torch.bfloat16)


def _capped_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   cap: float) -> torch.Tensor:
    """float32 [..., n, L]: the soft-capped logits plus the mask, up to a constant a row.
    cap * tanh(z) = 2 cap * sigmoid(2 z) - cap, and a softmax ignores a constant added to all its
    logits: 2 cap * sigmoid(2 s * scale / cap), in float32 (a bfloat16 sigmoid near 0.5 would lose
    the logits' precision; tanh took 2-3x the time of sigmoid here), the sigmoid over whole vectors
    (models/layers/elementwise.py: a run's scalar tail, the last row's last keys, gave them other
    bits). s = q.k in q's dtype (in bfloat16 oneDNN's `bmm`, 2-3x faster than float32's with the
    key conversion at 16 rows)."""
    *lead, n, d = q.shape
    keys, batch = k.shape[-2], q.numel() // (n * d)
    s = torch.bmm(q.reshape(batch, n, d), k.reshape(batch, keys, d).transpose(1, 2)).view(*lead, n, keys)
    logits = elementwise_on_padded_copy(s, lambda run: run.mul_(2 * scale / cap).sigmoid_(), dtype=torch.float32)
    logits.mul_(2 * cap)
    if mask is not None and mask.dtype == torch.bool:
        return logits.masked_fill_(~mask, float("-inf"))
    if mask is not None:
        return logits.add_(mask)  # the mask broadcast to the logits' shape
    return logits


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], slots int64 [N] -> [N, H, D] (one row copy per slot)."""
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    return flat.index_select(0, slots)


@contextlib.contextmanager
def _one_thread(on: bool):
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
            plan = meta.scratch[plan_key] = _make_plan(meta, k_cache.shape[1], sliding_window, q.dtype, group,
                                                       self.batch_invariant, self.prompt_form)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_skips)
        if plan.tails is not None:  # zeros, so that masked keys are finite (-inf + nan is nan)
            k_cache.view(-1, *k_cache.shape[2:]).index_fill_(0, plan.tails, 0)
            v_cache.view(-1, *v_cache.shape[2:]).index_fill_(0, plan.tails, 0)
        with _one_thread(self.batch_invariant and q.dtype == torch.float32):
            return self._attend_plan(q, k, v, k_cache, v_cache, plan, scale, group, softcap)

    def _attend_plan(self, q, k, v, k_cache, v_cache, plan: _Plan, scale: float, group: int,
                     softcap: float | None) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        num_blocks, block_size, _, head_dim = k_cache.shape
        out = None
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
                        index = plan.head_index[dec.start] = _head_major_index(blocks, rows, block_size,
                                                                               num_kv_heads)
                    head_major = (rows, num_kv_heads, dec.num_blocks * block_size, head_dim)
                    keys = k_cache.view(-1, head_dim).index_select(0, index).view(head_major)
                    values = v_cache.view(-1, head_dim).index_select(0, index).view(head_major)
                outs.append(_attend(q_dec[dec.start:dec.end], keys.to(q.dtype), values.to(q.dtype), dec.mask,
                                    scale, softcap))
            o_dec = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(-1, num_heads, head_dim)
            if plan.decode_in_order:
                out = o_dec
            else:
                out = torch.empty_like(q)
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
            keys = k.index_select(0, batch.gather).view(rows, length, num_kv_heads, head_dim).transpose(1, 2)
            values = v.index_select(0, batch.gather).view(rows, length, num_kv_heads, head_dim).transpose(1, 2)
            o = _attend(q_b, keys, values, batch.mask, scale, softcap)
            o = o.view(rows, num_kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
            out.index_copy_(0, batch.dest, o.reshape(rows * length, num_heads, head_dim).index_select(0, batch.valid))
        for row in plan.prefill:
            q_row = q[row.q_start:row.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if row.slots is None:
                keys, values = k[row.q_start:row.q_end], v[row.q_start:row.q_end]
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
    def _segment(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: _Segment,
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
        o = _softcapped(q_rows, keys, values, mask, scale, softcap)
    o = o[0, :, :rows].reshape(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3)
    return o.reshape(n, num_heads, head_dim)


_PROBE_CACHE: dict[tuple, bool] = {}


def prompt_form_invariant(num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                          block_size: int = 16, softcap: float | None = None) -> bool:
    """Whether the prompt form gives random tokens the same bits in segments of several sizes and
    offsets, with extra key padding, as each token alone (module docstring); measured once per shape
    (and soft-capping: then `_softcapped` instead of sdpa)."""
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
        for seg in _prompt_segments(meta, 0, start, count, start + count, block_size, None, group):
            blocks = torch.cat([seg.blocks, torch.arange(num_blocks - extra_blocks, num_blocks)])
            mask = seg.mask(blocks.shape[0] * block_size, dtype)  # the extra blocks lie past every token's keys
            outs.append(_prompt_segment(q[seg.start:seg.end], k_cache, v_cache, blocks, mask, scale, softcap))
        return torch.cat(outs)

    with torch.inference_mode(), _one_thread(dtype == torch.float32):  # as the backend attends
        per_segment = max(1, PROMPT_ROWS // group)
        ok = True
        for start, count, extra in ((0, per_segment, 0), (7, 2 * per_segment + 5, 2), (520, 41, 4), (300, 3, 0)):
            together = attend(start, count, extra)
            for t in range(count):
                if not torch.equal(attend(start + t, 1), together[t:t + 1]):
                    ok = False
    _PROBE_CACHE[key] = ok
    return ok
