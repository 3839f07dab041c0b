"""How the engine reports what it does, without depending on prometheus-client.

`opentgi.metrics` implements this interface with TGI's metric names; the engine calls the hooks
from its loop thread, so implementations must be cheap and thread-safe.
"""

from __future__ import annotations


class EngineObserver:
    """No-op base; override what you need."""

    def on_queue_size(self, waiting: int) -> None: ...

    def on_batch(self, *, method: str, size: int, max_tokens: int, duration_s: float, ok: bool,
                 forward_s: float | None = None, decode_s: float | None = None, filter_s: float | None = None,
                 next_size: int | None = None) -> None:
        """One forward: method is "prefill" (a step with any prompt tokens) or "decode".
        Optional finer timings (TGI's tgi_batch_forward/decode/filter_duration): the model forward,
        the detokenization, removing finished sequences; next_size: requests this step took from the
        queue (tgi_batch_next_size)."""

    def on_idle(self) -> None:
        """The last running sequence left: no batch runs until new requests arrive (TGI then sets
        tgi_batch_current_size and tgi_batch_current_max_tokens to 0)."""

    def on_batch_concat(self, *, reason: str) -> None:
        """New requests joined a running batch (TGI's tgi_batch_concat; reason "backpressure" or
        "wait_exceeded", see SchedulerOutput.concat_reason)."""

    def on_request_finished(self, *, request_id: str, ok: bool, input_tokens: int, generated_tokens: int,
                            queue_s: float, inference_s: float) -> None: ...

    def on_preemption(self, num_sequences: int) -> None: ...

    def on_kv_blocks(self, *, used: int, free: int, cached: int) -> None: ...

    def on_prefix_cache(self, *, hit_tokens: int, query_tokens: int) -> None:
        """Cumulative totals since start (as EngineStats.prefix_hit_tokens / prefix_query_tokens),
        reported after a step that changed them."""

    def on_speculation(self, *, draft_tokens: list[int], accepted_tokens: list[int]) -> None:
        """With --speculate, after each step that generated tokens: per sequence that did, the
        drafts it fed and how many of them were kept (TGI's tgi_request_skipped_tokens)."""
