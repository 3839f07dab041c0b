"""OpenTelemetry traces of requests (`--otlp-endpoint`, `--otlp-service-name`, as TGI's launcher).

Spans go through the OpenTelemetry SDK (batched) to an OTLP/HTTP (protobuf) collector: the endpoint
is the collector's base URL (`http://collector:4318`, `/v1/traces` is appended) or the full traces
URL. Each request is one trace, built when it finishes from its `RequestRecord` (the engine's
timings are monotonic stamps, placed on the wall clock at the request's arrival), with TGI's span
names:

    <operation>          the route's handler, as TGI names its spans (`generate`, `generate_stream`,
                         `chat_completions`, `completions`, ...; `METHOD path` when no route matched)
      validate           arrival -> queued in the engine (parsing, validation, tokenization)
      queued             queued -> first scheduled step
      infer              first scheduled step -> finished
        prefill          first scheduled step -> first token
        decode           first token -> finished

A `traceparent` header on the request (W3C trace context) makes the trace a child of the caller's.
The root span carries TGI's timing fields (total_time, validation_time, queue_time, inference_time,
time_per_token, in seconds) and the token counts.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from opentgi.api.server.request_context import RequestRecord

DEFAULT_SERVICE_NAME = "text-generation-inference.router"  # TGI's default --otlp-service-name


def traces_url(endpoint: str) -> str:
    """The collector's base URL gets OTLP/HTTP's traces path; a URL with a path is kept as it is."""
    endpoint = endpoint.rstrip("/")
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return endpoint if urlsplit(endpoint).path not in ("", "/") else f"{endpoint}/v1/traces"


class RequestTracer:
    def __init__(self, endpoint: str, service_name: str = DEFAULT_SERVICE_NAME, *, exporter=None):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = traces_url(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=self.endpoint)))
        self.tracer = self.provider.get_tracer("opentgi")
        self.propagator = TraceContextTextMapPropagator()

    def export(self, record: RequestRecord) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end = record.finished_at if record.finished_at is not None else record.started_at
        name = record.operation_name or f"{record.method} {record.path}"
        attributes = {"http.request.method": record.method, "url.path": record.path,
                      "request_id": record.request_id}
        if record.status is not None:
            attributes["http.response.status_code"] = record.status
        if record.input_tokens is not None:
            attributes["input_tokens"] = record.input_tokens
        if record.generated_tokens is not None:
            attributes["generated_tokens"] = record.generated_tokens
        attributes.update(record.durations())
        if record.error:
            attributes["error.type"] = record.error
        root = self.tracer.start_span(name, context=self.propagator.extract(record.headers), kind=SpanKind.SERVER,
                                      start_time=record.started_ns, attributes=attributes)
        failed = bool(record.error) or (record.status or 0) >= 500
        if failed:
            root.set_status(Status(StatusCode.ERROR, record.error or f"HTTP {record.status}"))
        under_root = trace.set_span_in_context(root)

        def child(span_name: str, start: float, stop: float, context=under_root, error: bool = False):
            span = self.tracer.start_span(span_name, context=context, start_time=record.wall_ns(start))
            if error:
                span.set_status(Status(StatusCode.ERROR, record.error or ""))
            span.end(end_time=record.wall_ns(max(stop, start)))
            return span

        t = record.timings
        if t is not None:
            child("validate", record.started_at, t.queued_at)
            finished = t.finished_at if t.finished_at is not None else end
            child("queued", t.queued_at, t.scheduled_at if t.scheduled_at is not None else finished)
            if t.scheduled_at is not None:
                infer = self.tracer.start_span("infer", context=under_root, start_time=record.wall_ns(t.scheduled_at))
                under_infer = trace.set_span_in_context(infer)
                first = t.first_token_at if t.first_token_at is not None else finished
                child("prefill", t.scheduled_at, first, under_infer)
                if t.first_token_at is not None:
                    child("decode", t.first_token_at, finished, under_infer)
                infer.end(end_time=record.wall_ns(max(finished, t.scheduled_at)))
        elif record.error == "validation":  # refused before it reached the engine
            child("validate", record.started_at, end, error=True)
        root.end(end_time=record.wall_ns(end))

    def shutdown(self) -> None:
        """Send what is still batched (server shutdown)."""
        self.provider.shutdown()


def request_tracer(endpoint: str | None, service_name: str | None) -> RequestTracer | None:
    if not endpoint:
        return None
    return RequestTracer(endpoint, service_name or DEFAULT_SERVICE_NAME)
