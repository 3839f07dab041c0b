"""What the engine hands back: token events while generating, one result at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentgi.engine.request import FinishReason


@dataclass
class TopToken:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass
class PrefillToken:
    id: int
    text: str
    logprob: float | None  # None for the first prompt token


@dataclass
class TokenEvent:
    index: int  # which sequence of the request (0 .. n-1)
    token_id: int
    token_text: str  # this token's text, decoded incrementally ("" while a UTF-8 char is incomplete)
    logprob: float  # log-softmax of the raw logits (before warpers) at the chosen token
    special: bool
    # Text safe to show now: token_text after stop-string hold-back and trimming. Concatenating the
    # text_delta of all events of a sequence gives SequenceResult.text.
    text_delta: str
    generated_tokens: int  # tokens generated so far by this sequence, this one included
    top_tokens: list[TopToken] | None = None
    finish_reason: FinishReason | None = None  # set on the sequence's last event


@dataclass
class SequenceResult:
    index: int
    token_ids: list[int]
    text: str  # generated text (stop string included or not per StoppingParams)
    finish_reason: FinishReason
    seed: int | None  # the seed actually used (None when greedy)
    tokens: list[TokenEvent] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_logprob(self) -> float:
        if not self.tokens:
            return float("-inf")
        return sum(t.logprob for t in self.tokens) / len(self.tokens)


@dataclass
class Timings:
    """time.monotonic() stamps; durations are differences of these."""

    queued_at: float
    scheduled_at: float | None = None  # first step that ran this request
    first_token_at: float | None = None
    finished_at: float | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[SequenceResult]
    timings: Timings
    prefill: list[PrefillToken] | None = None  # when request.prompt_logprobs
    score: float | None = None  # when request.score
