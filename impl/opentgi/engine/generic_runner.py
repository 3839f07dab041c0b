"""Runs any transformers causal LM the paged path does not cover (LoadedModel.kind == "generic").

Each sequence keeps its own HF `DynamicCache`; a step feeds every scheduled sequence its new tokens
against that cache. Sequences whose cache holds the same number of tokens and that feed one token
each (e.g. the n samples of one prompt, or requests of equal length) are not merged: HF caches of
different sequences cannot be concatenated cheaply, so this path is correct but slower. The block
manager still accounts the tokens, so the scheduler's limits and preemption behave as on the paged
path (a preempted sequence drops its cache and is recomputed).
"""

from __future__ import annotations

import inspect

import torch

from opentgi.engine.model_runner import StepOutput, _score_value
from opentgi.engine.sequence import Sequence


class GenericRunner:
    kind = "generic"

    def __init__(self, model, device: torch.device | str | None = None, compute_score=None):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.caches: dict[int, object] = {}  # seq_id -> DynamicCache
        params = inspect.signature(model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in params
        self._compute_score = compute_score

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
                logit_rows: list[int] = (), score_rows: list[int] = ()) -> StepOutput:
        out = StepOutput(sample_logits=None)
        sample_set = set(sample_rows)
        logit_set = set(logit_rows)
        score_set = set(score_rows)
        last_logits: dict[int, torch.Tensor] = {}
        for row, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
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

    def _score(self, seq: Sequence, ids: torch.Tensor, cache) -> float | None:
        """Reward model: the score at the prompt's last position (None for an earlier chunk)."""
        last_chunk = seq.num_computed_tokens + ids.shape[1] == seq.num_prompt_tokens
        if self._compute_score is not None:
            result = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                                output_hidden_states=True)
            self.caches[seq.seq_id] = result.past_key_values
            return _score_value(self._compute_score(result.hidden_states[-1][0, -1:])) if last_chunk else None
        # *ForSequenceClassification: logits [1, num_labels] at the chunk's last (non-pad) token
        result = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        self.caches[seq.seq_id] = result.past_key_values
        return _score_value(result.logits[0]) if last_chunk else None
