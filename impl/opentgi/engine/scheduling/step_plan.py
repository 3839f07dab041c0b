"""What one engine step does with each scheduled row, decided before the forward: which rows
sample a token, which need the logits of every new position (prompt logprobs), which are scored
(reward model); the step's timings (TGI's forward / decode / filter split); and the tokens each row
got from the sampler."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentgi.engine.scheduling.scheduler import SchedulerOutput


@dataclass
class StepTimings:
    """TGI's split: forward = model + token choice, decode = detokenize + stop checks, filter =
    removing the finished sequences from the batch."""

    started: float
    forward_s: float | None = None
    decode_s: float | None = None
    filter_s: float | None = None
    _last: float = 0.0

    def _lap(self) -> float:
        now = time.monotonic()
        lap, self._last = now - (self._last or self.started), now
        return lap

    def forward_done(self) -> None:
        self.forward_s = self._lap()

    def decode_done(self) -> None:
        self.decode_s = self._lap()

    def filter_done(self) -> None:
        self.filter_s = self._lap()


@dataclass
class StepPlan:
    timings: StepTimings
    committed: int  # tokens the running batch may hold (TGI's tgi_batch_current_max_tokens)
    sample_rows: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, out: SchedulerOutput, started: float, committed: int) -> StepPlan:
        plan = cls(StepTimings(started), committed)
        for row, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
            completes = n == seq.num_uncomputed_tokens + len(seq.draft_token_ids)
            if completes:
                (plan.score_rows if seq.request.score else plan.sample_rows).append(row)
            if seq.prompt_logprobs is not None and seq.index == 0 \
                    and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1 \
                    and seq.num_computed_tokens < seq.num_prompt_tokens:
                plan.logit_rows.append(row)
        return plan


@dataclass
class RowTokens:
    """Per scheduled row: the tokens chosen this step (one, several with speculative decoding, or
    none for a prompt chunk that does not complete), their logprobs and top-n alternatives."""

    token_ids: list[list[int]]
    logprobs: list[list[float | None]]
    top: list[list]

    @classmethod
    def empty(cls, num_rows: int) -> RowTokens:
        return cls([[] for _ in range(num_rows)], [[] for _ in range(num_rows)], [[] for _ in range(num_rows)])
