"""One record per HTTP request, for the request log line, the `x-request-id` header and tracing.

`RequestContextMiddleware` (outermost of the app's own middlewares) gives every request an id (the
client's `x-request-id` when it sends a usable one, else a new one), returns it in the
`x-request-id` response header, and binds a `RequestRecord` to a context variable while the request
runs. The recording functions every dialect calls (`api/request_metrics.py`) fill it in: prompt and
generated tokens, the engine's timings, the error type. When the response is done the middleware
writes one log line (`opentgi.request`: id, method, path, operation, status, tokens, queue and
inference time; JSON fields with `--json-output`) and hands the record to the tracer
(`api/server/tracing.py`) when `--otlp-endpoint` is set.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentgi.engine.events import Timings

REQUEST_ID_HEADER = "x-request-id"
TRACE_CONTEXT_HEADERS = frozenset({"traceparent", "tracestate"})  # W3C trace context, kept for tracing
_USABLE_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")  # printable, no spaces: safe in logs and headers
_current: ContextVar[RequestRecord | None] = ContextVar("opentgi_request_record", default=None)
log = logging.getLogger("opentgi.request")


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    started_at: float = field(default_factory=time.monotonic)  # time.monotonic(), as engine Timings
    started_ns: int = field(default_factory=time.time_ns)  # the same instant on the wall clock
    headers: dict[str, str] = field(default_factory=dict)  # the caller's trace context headers only
    operation: str | None = None  # e.g. "opentgi.api.tgi.handlers.generate" once routed
    status: int | None = None
    finished_at: float | None = None
    input_tokens: int | None = None
    generated_tokens: int | None = None
    timings: Timings | None = None  # the engine's stamps, when the request reached the engine
    error: str | None = None  # TGI's error_type when the request failed
    tenant: str | None = None  # the caller's tenant (--tenants / --api-key), never its key

    def wall_ns(self, monotonic: float) -> int:
        """A time.monotonic() stamp of this request as wall-clock nanoseconds."""
        return self.started_ns + int((monotonic - self.started_at) * 1e9)

    @property
    def operation_name(self) -> str | None:
        """The handler's name (TGI names its spans after its route functions: `generate`, ...)."""
        return self.operation.rsplit(".", 1)[-1] if self.operation else None

    def durations(self) -> dict[str, float]:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        out = {"total_time": end - self.started_at}
        t = self.timings
        if t is not None:
            scheduled = t.scheduled_at if t.scheduled_at is not None else t.queued_at
            finished = t.finished_at if t.finished_at is not None else end
            out.update(validation_time=max(t.queued_at - self.started_at, 0.0),
                       queue_time=max(scheduled - t.queued_at, 0.0),
                       inference_time=max(finished - scheduled, 0.0))
            if self.generated_tokens:
                out["time_per_token"] = out["inference_time"] / self.generated_tokens
        return out

    def fields(self) -> dict:
        out = {"request_id": self.request_id, "method": self.method, "path": self.path,
               "operation": self.operation_name, "status": self.status}
        if self.tenant is not None:
            out["tenant"] = self.tenant
        if self.input_tokens is not None:
            out["input_tokens"] = self.input_tokens
        if self.generated_tokens is not None:
            out["generated_tokens"] = self.generated_tokens
        out.update({k: round(v, 6) for k, v in self.durations().items()})
        if self.error:
            out["error"] = self.error
        return out


def current() -> RequestRecord | None:
    """The record of the request being served (None outside the middleware, as in handler tests)."""
    return _current.get()


def request_id_from(headers: dict[str, str]) -> str:
    incoming = headers.get(REQUEST_ID_HEADER, "")
    return incoming if _USABLE_ID.fullmatch(incoming) else uuid.uuid4().hex


class RequestContextMiddleware:
    """ASGI middleware: the request's id and record, its log line and its trace."""

    def __init__(self, app, *, tracer=None):
        self.app = app
        self.tracer = tracer  # api.tracing.RequestTracer or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extensions = scope.setdefault("extensions", {})  # Connexion's routing writes the operation here
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        record = RequestRecord(request_id=request_id_from(headers), method=scope.get("method", ""),
                               path=scope.get("path", ""),
                               headers={k: v for k, v in headers.items() if k in TRACE_CONTEXT_HEADERS})
        id_header = (REQUEST_ID_HEADER.encode(), record.request_id.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != id_header[0]]
                message = {**message, "headers": [*kept, id_header]}
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            if record.status is None:
                record.status = 500
            raise
        finally:
            _current.reset(token)
            record.finished_at = time.monotonic()
            record.operation = extensions.get("connexion_routing", {}).get("operation_id")
            self._report(record)

    def _report(self, record: RequestRecord) -> None:
        fields = record.fields()
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        log.info("request %s", text, extra={"fields": fields})
        if self.tracer is not None:
            try:
                self.tracer.export(record)
            except Exception:  # noqa: BLE001 - tracing must never fail a request
                log.warning("could not export the trace of request %s", record.request_id, exc_info=True)
