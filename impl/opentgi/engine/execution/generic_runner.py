"""Runs any transformers causal LM the paged path does not cover (LoadedModel.kind == "generic").

Each sequence keeps its own HF `DynamicCache`. Prompt chunks run one sequence at a time against it;
the step's decodes (one new token each) run as one batch: their caches are left-padded to the
longest, stacked, run with an attention mask and explicit positions, and split back (a copy of the
KV per step, cheaper than one forward per sequence; if a model's cache does not allow it, the
runner falls back to one forward per sequence). The block manager still accounts the tokens, so the
scheduler's limits and preemption behave as on the paged path (a preempted sequence drops its cache
and is recomputed). Correct, slower than the paged path.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

from opentgi.engine.execution.model_runner import StepOutput, score_value
from opentgi.engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)


class GenericRunner:
    kind = "generic"

    def __init__(self, model, device: torch.device | str | None = None, compute_score=None):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.caches: dict[int, object] = {}  # seq_id -> DynamicCache
        params = inspect.signature(model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in params
        self._compute_score = compute_score
        self._batch_decodes = True
        self.batched_decode_steps = 0

    def free(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)

    def _cache_for(self, seq: Sequence):
        from transformers import DynamicCache

        if seq.num_computed_tokens == 0 or seq.seq_id not in self.caches:
            if seq.num_computed_tokens != 0:
                raise RuntimeError(f"{seq}: generic runner lost its cache")
            self.caches[seq.seq_id] = DynamicCache()
        return self.caches[seq.seq_id]

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int], sample_rows: list[int],
                logit_rows: list[int] = (), score_rows: list[int] = (), greedy_vocab: int = 0) -> StepOutput:
        # greedy_vocab: transformers' models return logits, whatever the rows want of them
        out = StepOutput(sample_logits=None)
        sample_set = set(sample_rows)
        logit_set = set(logit_rows)
        score_set = set(score_rows)
        last_logits: dict[int, torch.Tensor] = {}
        decode_rows = [r for r, (seq, n) in enumerate(zip(seqs, num_new_tokens))
                       if n == 1 and seq.num_computed_tokens > 0 and not seq.request.score
                       and r not in logit_set and seq.seq_id in self.caches]
        if self._batch_decodes and len(decode_rows) > 1:
            try:
                last_logits.update(self._decode_batch([(r, seqs[r]) for r in decode_rows]))
                self.batched_decode_steps += 1
            except Exception:  # noqa: BLE001 - a cache layout we cannot stack: one by one from now on
                log.warning("generic runner: batched decode failed; running decodes one by one", exc_info=True)
                self._batch_decodes = False
        done = set(last_logits)
        for row, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            if row in done:
                continue
            start = seq.num_computed_tokens
            ids = torch.tensor([seq.token_ids[start:start + n]], dtype=torch.long, device=self.device)
            cache = self._cache_for(seq)
            if seq.request.score:  # every chunk of a scored prompt goes through the model's own head
                score = self._score(seq, ids, cache)
                if score is not None and row in score_set:
                    out.scores[row] = score
                continue
            kwargs = {}
            if self._logits_to_keep and row not in logit_set:
                kwargs["logits_to_keep"] = 1
            result = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **kwargs)
            self.caches[seq.seq_id] = result.past_key_values
            logits = result.logits[0].float()
            if row in logit_set:
                out.position_logits[row] = logits
            if row in sample_set:
                last_logits[row] = logits[-1]
        if sample_rows:
            out.sample_logits = torch.stack([last_logits[r] for r in sample_rows])
        return out

    def _decode_batch(self, rows: list[tuple[int, Sequence]]) -> dict[int, torch.Tensor]:
        from transformers import DynamicCache

        legacy = [self.caches[seq.seq_id].to_legacy_cache() for _, seq in rows]
        lens = [seq.num_computed_tokens for _, seq in rows]
        for layers, n in zip(legacy, lens):
            if layers[0][0].shape[2] != n:
                raise RuntimeError("cache length differs from the computed tokens")
        longest = max(lens)
        stacked = []
        for layer in range(len(legacy[0])):
            keys, values = [], []
            for layers, n in zip(legacy, lens):
                k, v = layers[layer]
                keys.append(F.pad(k, (0, 0, longest - n, 0)))
                values.append(F.pad(v, (0, 0, longest - n, 0)))
            stacked.append((torch.cat(keys), torch.cat(values)))
        B = len(rows)
        mask = torch.zeros(B, longest + 1, dtype=torch.long, device=self.device)
        for i, n in enumerate(lens):
            mask[i, longest - n:] = 1
        input_ids = torch.tensor([[seq.token_ids[seq.num_computed_tokens]] for _, seq in rows], device=self.device)
        positions = torch.tensor(lens, device=self.device).unsqueeze(1)
        kwargs = {"logits_to_keep": 1} if self._logits_to_keep else {}
        result = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            past_key_values=DynamicCache(stacked), use_cache=True, **kwargs)
        new_layers = result.past_key_values.to_legacy_cache()
        out = {}
        for i, ((row, seq), n) in enumerate(zip(rows, lens)):
            start = longest - n
            self.caches[seq.seq_id] = DynamicCache(
                [(k[i:i + 1, :, start:], v[i:i + 1, :, start:]) for k, v in new_layers])
            out[row] = result.logits[i, -1].float()
        return out

    def _score(self, seq: Sequence, ids: torch.Tensor, cache) -> float | None:
        """Reward model: the score at the prompt's last position (None for an earlier chunk)."""
        last_chunk = seq.num_computed_tokens + ids.shape[1] == seq.num_prompt_tokens
        if self._compute_score is not None:
            result = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                                output_hidden_states=True)
            self.caches[seq.seq_id] = result.past_key_values
            return score_value(self._compute_score(result.hidden_states[-1][0, -1:])) if last_chunk else None
        # *ForSequenceClassification: logits [1, num_labels] at the chunk's last (non-pad) token
        result = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        self.caches[seq.seq_id] = result.past_key_values
        return score_value(result.logits[0]) if last_chunk else None
