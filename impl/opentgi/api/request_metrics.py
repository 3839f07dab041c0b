"""TGI's request-level metrics, recorded the same way by every dialect's generation routes.

TGI's router records, per generation request: `tgi_request_count` on arrival, the input length and
`max_new_tokens` once validation passed, then either `tgi_request_success` with the durations
(total, validation, queue, inference, mean time per token) and the generated tokens, or
`tgi_request_failure{err}` with the error's TGI `error_type`. The TGI, OpenAI, LightLLM and SenseNova
handlers all call these four functions, so the counts on `/metrics` cover every route:

    started_at = record_start()
    record_validated(request)                  # the engine request built from the body
    durations = record_success(started_at, generated_tokens, result.timings)
    record_failure(exc)                        # any error the request ends with

The app's error handler calls `record_refused_body` for bodies Connexion refuses before a handler
runs, so those of TGI's checks that the document also states are counted as TGI counts them.
"""

from __future__ import annotations

import time

from opentgi.api import runtime
from opentgi.api.body_validation import BodySchemaError
from opentgi.api.errors import VALIDATION_PREFIX, ErrorReply, tgi_error
from opentgi.api.server import request_context
from opentgi.engine.errors import GenerationError
from opentgi.engine.events import Timings
from opentgi.engine.request import GenerationRequest

# TGI's generation operations: TGI runs its parameter checks inside them, so it counts their refusals.
TGI_GENERATION_OPERATIONS = frozenset({"opentgi.api.tgi.handlers.generate", "opentgi.api.tgi.handlers.generate_stream",
                                       "opentgi.api.tgi.handlers.compat_generate"})


def record_start() -> float:
    """A generation request arrived: counts it and returns its start time (time.monotonic)."""
    runtime.metrics().request_started()
    return time.monotonic()


def record_validated(request: GenerationRequest) -> None:
    """Validation passed: the prompt's length and the request's max_new_tokens."""
    runtime.metrics().request_validated(input_length=request.num_prompt_tokens,
                                        max_new_tokens=request.stopping.max_new_tokens)
    record = request_context.current()
    if record is not None:  # the request's log line and trace (several prompts: their sum)
        record.input_tokens = (record.input_tokens or 0) + request.num_prompt_tokens


def record_submitted(requests: list[GenerationRequest]) -> None:
    """The engine took the requests: opentgi_adapter_requests_total{adapter}, one per request, by the
    LoRA adapter serving it (the engine has resolved it: None is the base model, named by its id)."""
    metrics = runtime.metrics()
    base = runtime.engine().info.model_id
    for request in requests:
        metrics.request_submitted(request.adapter_id or base)


def record_failure(exc: BaseException) -> None:
    """The request failed: tgi_request_failure{err=<TGI error_type>}. A failure during generation
    also stops vouching for the engine's health (the next /health runs a probe)."""
    if isinstance(exc, GenerationError):
        runtime.state().last_success_at = None
    error_type = tgi_error(exc).error_type
    runtime.metrics().request_finished(ok=False, err=error_type)
    record = request_context.current()
    if record is not None:
        record.error = error_type


def durations(started_at: float, timings: Timings | None, now: float) -> dict[str, float]:
    """TGI's request durations in seconds: total; validation (arrival to queued), queue (queued to
    first scheduled) and inference (scheduled to now) when the engine's timings are known."""
    out = {"total_s": now - started_at}
    if timings is not None:
        scheduled = timings.scheduled_at if timings.scheduled_at is not None else timings.queued_at
        out.update(validation_s=max(timings.queued_at - started_at, 0.0),
                   queue_s=max(scheduled - timings.queued_at, 0.0), inference_s=max(now - scheduled, 0.0))
    return out


def record_success(started_at: float, generated_tokens: int, timings: Timings | None = None) -> dict[str, float]:
    """The request succeeded: tgi_request_success, its durations and generated tokens. Returns the
    durations recorded (TGI's response headers report the same ones)."""
    runtime.state().record_success()
    recorded = durations(started_at, timings, time.monotonic())
    record = request_context.current()
    if record is not None:
        record.generated_tokens = generated_tokens
        record.timings = timings
    runtime.metrics().request_finished(ok=True, generated_tokens=generated_tokens, **recorded)
    return recorded


def record_refused_body(operation_id: str, exc: BaseException, reply: ErrorReply) -> None:
    """Connexion refused a body before the handler ran. When TGI would have refused it in its handler
    (one of its own checks, such as `temperature` > 0, on a generation route) rather than while
    deserializing it, TGI counts the request and its failure: so do we."""
    if (operation_id in TGI_GENERATION_OPERATIONS and isinstance(exc, BodySchemaError)
            and reply.error.startswith(VALIDATION_PREFIX)):
        record_start()
        record_failure(exc)
