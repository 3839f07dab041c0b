"""Runs one step of the paged model: builds the step's tensors from the scheduled sequences, runs
the forward over the packed ("varlen") batch and returns the logits the engine needs.

Sequence b feeds tokens token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens[b]]
(with speculative decoding: its last token, then its draft_token_ids); their k/v go to the slots of
its block_table; its attention reads its first context_lens[b] tokens. Where the model picks a
kernel by row kind (`kernels_by_row_kind`: int4 layers with dense copies for prompt rows, prompt
attention in its own batch-invariant form), the forward runs with the step's row kinds
(models/layers/row_kinds.py) and the attention metadata says how many new tokens are prompt tokens.

A vision-language model's step first encodes the images whose tokens the step feeds and that are
not encoded yet (an encoder step of its own, before the decoder's), then hands the decoder those
tokens' rows. Batch-invariant (the default), each image is encoded alone, so its rows never depend
on the other images of the step; with --nondeterministic the step's images are encoded as one
batch (Idefics3: those of one tile size). With M-RoPE (Qwen2.5-VL) a sequence with images has
three positions per token, which its images give (the text after an image continues from it).
Gemma 3's image tokens attend each other both ways: the step tells the attention which rows
(AttentionMetadata.image_spans).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from opentgi.engine.execution.kv_cache import allocate_kv_caches
from opentgi.engine.scheduling.sequence import Sequence
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.layers.row_kinds import RowKinds, step_row_kinds


@dataclass
class StepOutput:
    # [sum of k, vocab]: the last k new positions of each sample row in order, k = 1 + its drafts
    sample_logits: torch.Tensor | None
    # each sample row's greedy token instead of its logits, where the step asked for them alone
    # (execute's greedy_vocab) and the model could give them
    sample_tokens: list[int] | None = None
    position_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [n_new, vocab]
    scores: dict[int, float] = field(default_factory=dict)  # row -> reward model score


def score_value(score: torch.Tensor) -> float:
    return float(score.float().reshape(-1)[0].item())


def in_mode(method):
    """A model entry point without its own `torch.inference_mode()` wrapper (functools.wraps keeps
    the function as `__wrapped__`), for callers already in inference mode: entering it again costs
    a decode step's host time and changes nothing."""
    fn, owner = getattr(method, "__wrapped__", None), getattr(method, "__self__", None)
    return method if fn is None or owner is None else fn.__get__(owner)


def sample_positions(seqs: list[Sequence], sample_rows: list[int], cu_q: list[int]) -> list[int]:
    """Where in the flat batch the sampled logits come from: each sample row's last 1 + (its
    drafts) new positions."""
    return [p for r in sample_rows for p in range(cu_q[r + 1] - 1 - len(seqs[r].draft_token_ids), cu_q[r + 1])]


_NUMPY_INTS = {torch.int64: np.int64, torch.int32: np.int32}


class ModelRunner:
    kind = "paged"

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model = model
        self.spec = model.spec
        self.device = torch.device(self.spec.device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.spec, num_blocks, block_size)
        self._pad_block = -1 if self.device.type == "cpu" else 0
        self.lora = getattr(model, "lora", None)  # models/lora/ LoraState when adapters are loaded
        self.kernels_by_row_kind = bool(getattr(model, "kernels_by_row_kind", False))
        self.vision = getattr(model, "vision", None)  # a vision-language model's image encoder

    def free(self, seq: Sequence) -> None:
        """Nothing to drop: the paged cache belongs to the block manager."""

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q = [0]
        cu_k = [0]
        context_lens: list[int] = []
        max_blocks = 0
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            elif seq.draft_token_ids:
                input_ids.extend(seq.token_ids[start:])
                input_ids.extend(seq.draft_token_ids)
                positions.extend(range(start, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            context_lens.append(end)
            max_blocks = max(max_blocks, len(table))
        pad = self._pad_block
        block_tables = [s.block_table + [pad] * (max_blocks - len(s.block_table)) for s in seqs]
        dev = self.device

        def t(values, dtype):
            if dev.type == "cpu":  # a numpy array and a tensor on its memory: cheaper than torch.tensor
                return torch.from_numpy(np.array(values, dtype=_NUMPY_INTS[dtype]))
            return torch.tensor(values, dtype=dtype, device=dev)

        attn = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            cu_seqlens_q=t(cu_q, torch.int32),
            cu_seqlens_k=t(cu_k, torch.int32),
            max_seqlen_q=max(num_new_tokens),
            max_seqlen_k=max(context_lens),
            context_lens=t(context_lens, torch.int32),
            block_tables=t(block_tables, torch.int32),
            decode_only=all(n == 1 for n in num_new_tokens),
            prompt_new_tokens=self._prompt_new_tokens(seqs, num_new_tokens) if self.kernels_by_row_kind else None,
        )
        return t(input_ids, torch.int64), t(positions, torch.int64), attn, cu_q

    @staticmethod
    def _prompt_new_tokens(seqs: list[Sequence], num_new_tokens: list[int]) -> list[int]:
        """How many of each sequence's new tokens are prompt tokens: those before its prompt end."""
        return [max(0, min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens)
                for s, n in zip(seqs, num_new_tokens)]

    def row_kinds(self, prompt_new_tokens: list[int] | None, num_new_tokens: list[int]) -> RowKinds | None:
        """The step's prompt and generated rows, from the counts `prepare` put in the attention
        metadata (None where the model does not tell them apart)."""
        if prompt_new_tokens is None:
            return None
        return RowKinds(prompt_new_tokens, num_new_tokens, self.device)

    def encode_images(self, images: list) -> None:
        """Set `embeds` of each ImageInput (the encoder step): batch-invariant, each image alone."""
        batched = not getattr(self.model, "batch_invariant", False) and len(images) > 1
        self.vision.encode_images(images, batched)

    def mrope_positions(self, seqs: list[Sequence], num_new_tokens: list[int], flat: torch.Tensor) -> torch.Tensor:
        """[3, T] M-RoPE positions of the step's tokens (`flat`: their plain positions), from each
        sequence's images (a sequence without images keeps its plain ones in all three)."""
        positions = flat.unsqueeze(0).repeat(3, 1)
        at = 0
        for seq, n in zip(seqs, num_new_tokens):
            if seq.request.images:
                start = seq.num_computed_tokens
                positions[:, at:at + n] = self.vision.mrope_positions(seq.request.images, start, start + n).to(flat.device)
            at += n
        return positions

    @staticmethod
    def image_spans(seqs: list[Sequence], num_new_tokens: list[int], cu_q: list[int]) -> list[tuple]:
        """The step's image tokens that attend each other both ways (AttentionMetadata.image_spans);
        the scheduler keeps each image within one step."""
        spans = []
        for b, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            for image in seq.request.images:
                first, last = max(start, image.start), min(end, image.end)
                if image.bidirectional and first < last:
                    if image.end > end:
                        raise RuntimeError("a step ends inside an image whose tokens attend each other both ways")
                    spans.append((cu_q[b] + first - start, b, first, last, image.start, image.end))
        return spans

    def image_embeds(self, seqs: list[Sequence], num_new_tokens: list[int], cu_q: list[int]):
        """(flat indices, rows) of the step's image tokens, encoding the images first where needed;
        None when the step feeds none."""
        fed: list[tuple[int, object, int, int]] = []  # (flat offset of the row's start, image, first, last)
        for row, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            for image in seq.request.images:
                if image.start < end and image.end > start:
                    fed.append((cu_q[row] - start, image, start, end))
        if not fed:
            return None
        pending = {id(image): image for _, image, _, _ in fed if image.embeds is None}
        if pending:
            self.encode_images(list(pending.values()))
        index: list[int] = []
        rows: list[torch.Tensor] = []
        for offset, image, start, end in fed:
            picked = [k for k, p in enumerate(image.positions) if start <= p < end]
            if picked:
                index.extend(offset + image.positions[k] for k in picked)
                rows.append(image.embeds[picked[0]:picked[-1] + 1])
        if not rows:  # the step's tokens lie between the image's tiles (their tags)
            return None
        return torch.tensor(index, dtype=torch.int64, device=self.device), torch.cat(rows)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int], sample_rows: list[int],
                logit_rows: list[int] = (), score_rows: list[int] = (), greedy_vocab: int = 0) -> StepOutput:
        """The step's outputs. greedy_vocab > 0: every sample row wants only the argmax of its
        first greedy_vocab logits, which may come back as sample_tokens instead of the logits."""
        input_ids, positions, attn, cu_q = self.prepare(seqs, num_new_tokens)
        extra = {}
        if self.vision is not None and any(s.request.images for s in seqs):
            image_embeds = self.image_embeds(seqs, num_new_tokens, cu_q)
            if image_embeds is not None:
                extra["image_embeds"] = image_embeds
            if getattr(self.vision, "mrope", False):  # the whole sequence's positions follow its images
                positions = self.mrope_positions(seqs, num_new_tokens, positions)
            if getattr(self.vision, "bidirectional", False):
                attn.image_spans = self.image_spans(seqs, num_new_tokens, cu_q) or None
        if self.lora is not None:
            self.lora.begin_step([s.request.adapter_id for s in seqs], num_new_tokens)
        prompt_new = attn.prompt_new_tokens
        decode_logits = getattr(self.model, "decode_logits", None)
        if (decode_logits is not None and sample_rows and not logit_rows and not score_rows and not extra
                and self.lora is None and (prompt_new is None or not any(prompt_new))
                and sample_positions(seqs, sample_rows, cu_q) == list(range(cu_q[-1]))):
            # every row sampled in order: its logits (or greedy tokens) in one call where the model has it
            logits = in_mode(decode_logits)(input_ids, positions, attn, self.kv_caches, greedy=greedy_vocab)
            if logits is not None and greedy_vocab:
                return StepOutput(sample_logits=None, sample_tokens=logits.tolist())
            if logits is not None:
                return StepOutput(sample_logits=logits)
        forward = in_mode(self.model.forward)
        try:
            if prompt_new is None or not any(prompt_new):  # every row generated: as a forward without kinds
                hidden = forward(input_ids, positions, attn, self.kv_caches, **extra)
            else:
                with step_row_kinds(self.row_kinds(prompt_new, num_new_tokens)):
                    hidden = forward(input_ids, positions, attn, self.kv_caches, **extra)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        out = StepOutput(sample_logits=None)
        if sample_rows:
            rows = sample_positions(seqs, sample_rows, cu_q)
            # every row sampled in order (a step of decode rows): the hidden states as they are
            picked = hidden if rows == list(range(hidden.shape[0])) else \
                hidden.index_select(0, torch.tensor(rows, device=self.device))
            out.sample_logits = in_mode(self.model.compute_logits)(picked)
        for r in logit_rows:
            out.position_logits[r] = self.model.compute_logits(hidden[cu_q[r]:cu_q[r + 1]])
        for r in score_rows:
            out.scores[r] = score_value(self.model.compute_score(hidden[cu_q[r + 1] - 1:cu_q[r + 1]]))
        return out
