"""The CPU attention backend's plan of a step: which rows are attended how, built once per step.

Decode rows (one new token) are attended in groups of similar context length (`decode_groups`:
sorted, cut where the modelled cost, a fixed cost per group plus the padded key rows attended, is
least), their keys gathered in whole blocks. Fresh prompts of at most `MAX_BATCHED_PROMPT` tokens
are attended together in batches of similar length (`PromptBatch`), padded to the longest. Other
rows with several new tokens (prefill chunks, prompts after a cached prefix, long prompts) are
attended one sequence at a time with a causal mask offset by the cached length (`PrefillRow`); a
row of at most `MAX_TOKENWISE_QUERY` new tokens after cached ones (speculative decoding's verify
rows) token by token like lone decode rows.

With batch invariance every row of several tokens is cut into `Segment`s of `SEGMENT_TOKENS`
tokens, each token attended as a decode row, and prompt tokens (where the probe passed) into
`PromptSegment`s: up to `PROMPT_ROWS` query rows of one sequence on one batch entry's query axis,
padded to whole `ROW_BLOCK`s (torch_backend.py says why these forms keep rows invariant).
What depends only on the step (slot indices, masks) is computed here once and kept in `meta.scratch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opentgi.models.attention.metadata import AttentionMetadata

# A decode group's fixed cost (one scaled_dot_product_attention call and two block gathers per
# layer), counted in key rows attended (one row's one key): the unit of `decode_groups`' cost model.
GROUP_COST_KEYS = 1000
MAX_TOKENWISE_QUERY = 16
MAX_BATCHED_PROMPT = 128  # fresh prompts up to this many tokens are attended in padded batches
SEGMENT_TOKENS = 64  # batch invariance: tokens of one sequence attended per call, sharing one key gather
ROW_BLOCK = 32  # prompt form: query rows padded to whole blocks of this many (sdpa's for < 192 rows)
PROMPT_ROWS = 160  # prompt form: the most query rows a call (under 192, where sdpa cuts in 64s)


@dataclass
class PrefillRow:
    q_start: int
    q_end: int
    context_len: int
    slots: torch.Tensor | None  # int64 [context_len]; None: no cached prefix, attend over this step's k/v
    mask: torch.Tensor | None  # bool [q_len, context_len]; None: plain causal


@dataclass
class DecodeGroup:
    start: int  # the group's rows are decode rows start:end of the step (in the plan's order)
    end: int
    num_blocks: int  # blocks per row: the group's longest context, rounded up to whole blocks
    mask: torch.Tensor | None  # additive [end - start, 1, 1, num_blocks * block_size]; None: all visible


@dataclass
class PromptBatch:
    """Fresh prompts attended together, each padded to the batch's longest (`length`)."""
    rows: int
    length: int
    gather: torch.Tensor  # int64 [rows * length]: the step's token row at each padded position
    valid: torch.Tensor  # int64: the padded positions that hold real tokens
    dest: torch.Tensor  # int64: the step's token row of each of those
    mask: torch.Tensor  # additive [rows, 1, group * length, length]: causal, padding keys hidden


@dataclass
class Segment:
    """Batch invariance: query tokens start:end of one sequence, each attended as a decode row."""
    start: int
    end: int
    blocks: torch.Tensor  # int64 [num_blocks]: the sequence's blocks up to the segment's last token
    mask: torch.Tensor | None  # additive [end - start, 1, 1, num_blocks * block_size]; None: all visible


@dataclass
class PromptSegment:
    """Prompt tokens start:end of one sequence, their query rows on one batch entry's query axis.
    Its mask ([1, 1, padded rows, keys]: a row per token and query head of a kv head) is built
    when attended, so that a long prompt's step holds one at a time."""
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
class NativeRows:
    """Tokens attended by the native decode kernel (native_backend.py), each as a decode row: its
    sequence's block table row and its own context length (its position + 1)."""
    tokens: torch.Tensor  # int64 [N]: the step's token rows
    seq: torch.Tensor  # int32 [N]: each token's row of block_tables
    ctx: torch.Tensor  # int32 [N]: each token's keys (the positions before it and its own)
    block_tables: torch.Tensor  # int32 [B, width], contiguous
    in_order: bool  # tokens is 0..T-1


@dataclass
class Plan:
    has_skips: bool
    decode_tokens: torch.Tensor | None  # int64 [Nd]: the flat-batch row of each decode row, grouped
    decode_blocks: torch.Tensor | None  # int64: each group's rows' block ids, num_blocks per row
    decode_in_order: bool  # decode_tokens is 0..T-1: the step is all decode rows, already in group order
    tails: torch.Tensor | None  # int64: slots past the context in last blocks this step entered
    decode: list[DecodeGroup]
    prefill: list[PrefillRow]
    prompts: list[PromptBatch]
    segments: list[Segment]
    prompt_segments: list[PromptSegment]
    # soft-capped decode groups: each group's (row, kv head, position) cache rows, built by the
    # step's first layer (`head_major_index`)
    head_index: dict[int, torch.Tensor] = field(default_factory=dict)
    native: NativeRows | None = None  # make_plan(native=True): the tokens in the decode row's form
    native_prompt: NativeRows | None = None  # make_plan(native=True): prompt tokens in the native prompt form


def head_major_index(blocks: torch.Tensor, rows: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
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


def decode_groups(rows: list[int], lens: list[int], block_size: int) -> list[list[int]]:
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
                  window: int | None, dtype: torch.dtype) -> tuple[DecodeGroup, torch.Tensor]:
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
    return DecodeGroup(start, start + len(rows), num_blocks, mask), blocks.reshape(-1)


def _segments(meta: AttentionMetadata, b: int, q_start: int, q_len: int, ctx: int, block_size: int,
              window: int | None, dtype: torch.dtype) -> list[Segment]:
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
        out.append(Segment(q_start + first, q_start + first + n, blocks, mask))
    return out


def cut_into_prompt_segments(meta: AttentionMetadata, b: int, q_start: int, q_len: int, ctx: int, block_size: int,
                     window: int | None, group: int) -> list[PromptSegment]:
    """Sequence b's q_len prompt tokens (flat rows q_start..), the last at context ctx, in segments
    of at most PROMPT_ROWS // group tokens (module docstring)."""
    per_segment = max(1, PROMPT_ROWS // group)
    out = []
    for first in range(0, q_len, per_segment):
        n = min(per_segment, q_len - first)
        last_ctx = ctx - q_len + first + n
        num_blocks = -(-last_ctx // block_size)
        out.append(PromptSegment(q_start + first, q_start + first + n, meta.block_tables[b, :num_blocks].long(),
                                  last_ctx, group, window))
    return out


def prompt_batches(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
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
                  device: torch.device) -> PromptBatch:
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
    return PromptBatch(len(spans), length, gather, valid, gather.index_select(0, valid), mask)


def make_plan(meta: AttentionMetadata, block_size: int, window: int | None, dtype: torch.dtype,
               heads_per_kv: int, batch_invariant: bool = False, prompt_form: bool = False,
               native: bool = False) -> Plan:
    """The step's plan. With `native`, every token the torch form attends as a decode row (decode
    rows, `Segment` tokens, speculative verify tokens) is listed in `Plan.native` instead, for the
    native kernel, and the prompt form's tokens in `Plan.native_prompt`, for the native prompt
    kernel: the same tokens, so a token's form still follows only its kind."""
    prompt_new = meta.prompt_new_tokens if batch_invariant and prompt_form else None
    if native and meta.decode_only and not (prompt_new and any(prompt_new)):
        return _native_decode_plan(meta, block_size)
    cu_q = meta.cu_seqlens_q.tolist()
    context_lens = meta.context_lens.tolist()
    device = meta.block_tables.device
    decode_seqs, prefill, fresh = [], [], []
    # decode work as (sequence rows, context lengths, flat-batch token rows) per group
    groups: list[tuple[list[int], list[int], list[int]]] = []
    tails: list[int] = []
    segments: list[Segment] = []
    prompt_segments: list[PromptSegment] = []
    native_rows: list[tuple[int, int, int]] = []  # (token row, sequence, context) with `native`
    prompt_rows: list[tuple[int, int, int]] = []  # the same for prompt tokens, with `native` and `prompt_form`

    def as_rows(b: int, q_start: int, n: int, last_ctx: int, into: list = native_rows) -> None:
        into.extend((q_start + j, b, last_ctx - n + 1 + j) for j in range(n))
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
        if num_prompt and native:  # the native prompt form, then any generated tokens as decode rows
            as_rows(b, cu_q[b], num_prompt, ctx - q_len + num_prompt, prompt_rows)
            if num_prompt < q_len:
                as_rows(b, cu_q[b] + num_prompt, q_len - num_prompt, ctx)
            continue
        if num_prompt:  # prompt tokens first (their own form), then any generated ones
            prompt_segments += cut_into_prompt_segments(meta, b, cu_q[b], num_prompt, ctx - q_len + num_prompt,
                                                block_size, window, heads_per_kv)
            if num_prompt < q_len and native:
                as_rows(b, cu_q[b] + num_prompt, q_len - num_prompt, ctx)
            elif num_prompt < q_len:
                segments += _segments(meta, b, cu_q[b] + num_prompt, q_len - num_prompt, ctx, block_size,
                                      window, dtype)
            continue
        if native and (q_len == 1 or batch_invariant or (q_len <= MAX_TOKENWISE_QUERY and ctx > q_len)):
            as_rows(b, cu_q[b], q_len, ctx)
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
                prefill.append(PrefillRow(cu_q[b], cu_q[b + 1], ctx, None, None))
            continue
        num_blocks = -(-ctx // block_size)
        slots = _slots(meta.block_tables[b, :num_blocks], ctx, block_size)
        prefill.append(PrefillRow(cu_q[b], cu_q[b + 1], ctx, slots,
                                   _causal_mask(q_len, ctx, window).to(device)))
    if decode_seqs:
        lens = [context_lens[b] for b in decode_seqs]
        for group in decode_groups(decode_seqs, lens, block_size):
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
    has_skips = _any_skip(meta.slot_mapping)
    decode_in_order = tokens == list(range(cu_q[-1]))
    tail_slots = torch.tensor(tails, dtype=torch.long, device=device) if tails else None
    prompts = []
    for spans in prompt_batches(fresh):
        if len(spans) == 1:  # alone: attended as is, no padding
            prefill.append(PrefillRow(spans[0][0], spans[0][1], spans[0][1] - spans[0][0], None, None))
        else:
            prompts.append(_prompt_batch(spans, heads_per_kv, dtype, device))
    plan = Plan(has_skips, decode_tokens, decode_blocks, decode_in_order, tail_slots, decode, prefill,
                prompts, segments, prompt_segments)
    if native_rows or prompt_rows:
        tables = meta.block_tables.to(torch.int32).contiguous()
        plan.native = _native_rows(native_rows, tables, cu_q[-1])
        plan.native_prompt = _native_rows(prompt_rows, tables, cu_q[-1])
    return plan


def _native_rows(listed: list[tuple[int, int, int]], tables: torch.Tensor, num_tokens: int) -> NativeRows | None:
    if not listed:
        return None
    rows, seqs, ctxs = zip(*listed, strict=True)
    device = tables.device
    return NativeRows(torch.tensor(rows, dtype=torch.long, device=device),
                      torch.tensor(seqs, dtype=torch.int32, device=device),
                      torch.tensor(ctxs, dtype=torch.int32, device=device), tables,
                      list(rows) == list(range(num_tokens)))


def _native_decode_plan(meta: AttentionMetadata, block_size: int) -> Plan:
    """`make_plan(native=True)` of a step of decode rows alone (one new token a sequence, none a
    prompt token): the plan the general loop builds (each token a native row, in order), in the
    few ops a decode step can afford."""
    context_lens = meta.context_lens.tolist()
    tails: list[int] = []
    for b, ctx in enumerate(context_lens):
        if ctx % block_size == 1:  # the token is its block's first: the loop's tail condition at one token
            first = int(meta.block_tables[b, ctx // block_size]) * block_size
            tails += range(first + ctx % block_size, first + block_size)
    device = meta.block_tables.device
    num = len(context_lens)
    tokens, seqs = _RANGES.get((num, device)) or _ranges(num, device)
    rows = NativeRows(tokens, seqs, _int32(meta.context_lens), _int32(meta.block_tables), True)
    tail_slots = torch.tensor(tails, dtype=torch.long, device=device) if tails else None
    return Plan(_any_skip(meta.slot_mapping), None, None, num == 0, tail_slots, [], [], [], [], [],
                native=rows if num else None)


# (0..n-1 as int64, as int32) per (n, device): the in-order decode plan's token and sequence rows,
# read-only, kept rather than built every step
_RANGES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _ranges(num: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.arange(num, dtype=torch.long, device=device)
    _RANGES[(num, device)] = found = (tokens, tokens.to(torch.int32))
    return found


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int32 tensor (itself where it is one: no op dispatched)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _any_skip(slot_mapping: torch.Tensor) -> bool:
    """Some slot is -1 (a token whose k/v is not stored); on CPU by numpy (no torch op a step)."""
    if not slot_mapping.numel():
        return False
    if slot_mapping.device.type == "cpu":
        return bool((slot_mapping.numpy() < 0).any())
    return bool((slot_mapping < 0).any())
