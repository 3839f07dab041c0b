"""Request traces (--otlp-endpoint) received by a real OTLP/HTTP receiver, and the per-request log
line and x-request-id header, on a live server with the tiny model."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from conformance.live import free_port, serve
from opentgi.api.server.request_context import request_id_from
from opentgi.api.server.tracing import traces_url
from opentgi.cli import _JsonFormatter, build_parser, settings_from
from opentgi.config import Settings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class OtlpReceiver:
    """An OTLP/HTTP collector: decodes every ExportTraceServiceRequest posted to /v1/traces."""

    def __init__(self):
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                assert self.headers["Content-Type"] == "application/x-protobuf"
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver.requests.append(message)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) of everything received."""
        out = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    out.extend((resource, span) for span in scope_spans.spans)
        return out


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = getattr(value, value.WhichOneof("value"))
    return out


@pytest.fixture(scope="module")
def traced(tiny_llama):
    """A live server sending its traces to a receiver; the requests of the tests below are made in
    here, and the receiver's spans read after the server stopped (its shutdown flushes them)."""
    with OtlpReceiver() as receiver:
        settings = Settings(model_id=str(tiny_llama), hostname="127.0.0.1", port=free_port(),
                            max_batch_total_tokens=2048, otlp_endpoint=receiver.url,
                            otlp_service_name="opentgi-test")
        answers = {}
        handler = _Capture()
        request_log = logging.getLogger("opentgi.request")
        level = request_log.level
        request_log.setLevel(logging.INFO)  # as `opentgi serve` configures logging
        request_log.addHandler(handler)
        try:
            with serve(settings) as url, httpx.Client(base_url=url, timeout=60) as client:
                answers["generate"] = client.post(
                    "/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 3}},
                    headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01", "x-request-id": "client-id-7"})
                with client.stream("POST", "/generate_stream",
                                   json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}) as stream:
                    answers["stream_body"] = stream.read()
                    answers["generate_stream"] = stream
                answers["invalid"] = client.post(
                    "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "top_p": 2}})
                answers["chat"] = client.post("/v1/chat/completions", json={
                    "model": "tgi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
                answers["chat_stream"] = client.post("/v1/chat/completions", json={
                    "model": "tgi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                    "stream": True})
                answers["health"] = client.get("/health", headers={"x-request-id": "bad id\twith spaces"})
        finally:
            request_log.removeHandler(handler)
            request_log.setLevel(level)
        yield receiver, answers, handler.records


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def by_trace(receiver) -> dict[bytes, dict[str, object]]:
    traces: dict[bytes, dict[str, object]] = {}
    for _, span in receiver.spans():
        traces.setdefault(span.trace_id, {})[span.name] = span
    return traces


def test_spans_reach_the_receiver_with_tgis_names_and_the_callers_trace(traced):
    receiver, answers, _ = traced
    assert answers["generate"].status_code == 200
    assert set(receiver.paths) == {"/v1/traces"}
    resources = {r["service.name"] for r, _ in receiver.spans()}
    assert resources == {"opentgi-test"}
    generate = by_trace(receiver)[bytes.fromhex(TRACE_ID)]  # the caller's trace id, from traceparent
    assert set(generate) == {"generate", "validate", "queued", "infer", "prefill", "decode"}
    root = generate["generate"]
    assert root.parent_span_id == bytes.fromhex(PARENT_SPAN_ID)
    assert root.kind == root.SPAN_KIND_SERVER
    for name in ("validate", "queued", "infer"):
        assert generate[name].parent_span_id == root.span_id
    for name in ("prefill", "decode"):
        assert generate[name].parent_span_id == generate["infer"].span_id
    order = [generate[n] for n in ("validate", "queued", "infer")]
    assert root.start_time_unix_nano <= order[0].start_time_unix_nano
    for before, after in zip(order, order[1:]):
        assert before.end_time_unix_nano <= after.start_time_unix_nano + 1000
    assert generate["prefill"].end_time_unix_nano <= generate["decode"].start_time_unix_nano + 1000
    assert generate["infer"].end_time_unix_nano <= root.end_time_unix_nano
    fields = attrs(root)
    assert fields["generated_tokens"] == 3 and fields["input_tokens"] >= 1
    assert fields["http.response.status_code"] == 200 and fields["request_id"] == "client-id-7"
    assert fields["total_time"] >= fields["inference_time"] > 0 and "queue_time" in fields


def test_every_dialect_route_is_traced_and_failures_are_marked(traced):
    receiver, answers, _ = traced
    roots = {}
    for spans in by_trace(receiver).values():
        for name in ("generate_stream", "chat_completions", "generate", "health"):
            if name in spans:
                roots.setdefault(name, []).append(spans)
    assert answers["generate_stream"].status_code == 200 and answers["chat"].status_code == 200
    assert {"decode", "prefill"} <= set(roots["generate_stream"][0])
    assert answers["chat_stream"].status_code == 200 and len(roots["chat_completions"]) == 2
    for spans in roots["chat_completions"]:  # streamed or not: the engine's spans
        assert {"validate", "queued", "infer", "prefill", "decode"} <= set(spans)
    assert answers["invalid"].status_code == 422
    refused = [s for s in roots["generate"] if "infer" not in s]
    assert len(refused) == 1 and set(refused[0]) == {"generate", "validate"}
    root = refused[0]["generate"]
    assert root.status.code == root.status.STATUS_CODE_ERROR and attrs(root)["error.type"] == "validation"
    assert attrs(root)["http.response.status_code"] == 422


def test_request_id_header_and_one_log_line_per_request(traced):
    _, answers, records = traced
    assert answers["generate"].headers["x-request-id"] == "client-id-7"  # the client's id, honoured
    own = answers["generate_stream"].headers["x-request-id"]
    assert len(own) == 32 and own != answers["chat"].headers["x-request-id"]
    assert answers["health"].headers["x-request-id"] != "bad id\twith spaces"  # unusable: replaced
    assert answers["invalid"].headers["x-request-id"]
    lines = {r.fields["request_id"]: r.fields for r in records}
    assert len(records) == len(lines) == 6
    line = lines["client-id-7"]
    assert line["method"] == "POST" and line["path"] == "/generate" and line["operation"] == "generate"
    assert line["status"] == 200 and line["generated_tokens"] == 3 and line["input_tokens"] >= 1
    assert line["queue_time"] >= 0 and line["inference_time"] > 0 and line["total_time"] >= line["inference_time"]
    assert lines[own]["operation"] == "generate_stream" and lines[own]["generated_tokens"] == 2
    invalid = lines[answers["invalid"].headers["x-request-id"]]
    assert invalid["status"] == 422 and invalid["error"] == "validation" and "inference_time" not in invalid
    text = records[0].getMessage()
    assert text.startswith("request request_id=client-id-7 method=POST path=/generate operation=generate status=200")
    entry = json.loads(_JsonFormatter().format(records[0]))  # --json-output: the fields as JSON keys
    assert entry["request_id"] == "client-id-7" and entry["generated_tokens"] == 3 and entry["level"] == "INFO"


def test_request_ids_and_traces_url():
    assert request_id_from({"x-request-id": "abc-123"}) == "abc-123"
    assert request_id_from({"x-request-id": "a" * 129}) != "a" * 129
    assert len(request_id_from({})) == 32
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/custom/path") == "https://otel.example/custom/path"


def test_otlp_flags_and_environment():
    parser = build_parser()
    settings = settings_from(parser.parse_args(["serve", "--otlp-endpoint", "http://c:4318"]),
                             {"OTLP_SERVICE_NAME": "svc"})
    assert (settings.otlp_endpoint, settings.otlp_service_name) == ("http://c:4318", "svc")
    assert settings_from(parser.parse_args(["serve"]), {}).otlp_service_name == "text-generation-inference.router"
    assert settings_from(parser.parse_args(["serve"]), {"OTLP_ENDPOINT": "c:4318"}).otlp_endpoint == "c:4318"
