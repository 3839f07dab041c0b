"""What the engine loop keeps of one request while it runs: its sequences and the result being
built. Lives on the engine thread; the asyncio side only sees the deliveries made from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentgi.engine.events import GenerationResult, PrefillToken, SequenceResult, Timings, TokenEvent
from opentgi.engine.request import GenerationRequest
from opentgi.engine.scheduling.sequence import Sequence


class RequestState:
    def __init__(self, request: GenerationRequest, seqs: list[Sequence], handle, queued_at: float):
        self.request = request
        self.seqs = seqs
        self.handle = handle  # RequestHandle, touched only through deliveries on the event loop
        self.timings = Timings(queued_at=queued_at)
        self.events: list[list[TokenEvent]] = [[] for _ in seqs]
        self.num_unfinished = len(seqs)
        self.prefill: list[PrefillToken] | None = None
        self.score: float | None = None
        self.done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def build_result(self) -> GenerationResult:
        sequences = [
            SequenceResult(index=s.index, token_ids=s.generated_token_ids, text=s.text,
                           finish_reason=s.finish_reason, seed=s.seed if s.request.sampling.do_sample else None,
                           tokens=self.events[s.index])
            for s in self.seqs]
        return GenerationResult(request_id=self.request_id, prompt_token_ids=list(self.request.prompt_token_ids),
                                sequences=sequences, timings=self.timings, prefill=self.prefill, score=self.score,
                                num_cached_tokens=self.seqs[0].num_prompt_cached_tokens or 0)


@dataclass
class Delivery:
    """One step's news for one request, handed to the event loop in a single call."""

    state: RequestState
    events: list[TokenEvent] = field(default_factory=list)
    result: GenerationResult | None = None
    error: Exception | None = None
