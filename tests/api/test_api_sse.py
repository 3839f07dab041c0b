"""The shared SSE helper: framing byte for byte, the error event, cancellation when the client goes."""

from __future__ import annotations

import asyncio

import httpx

from opentgi.api.sse import sse_event, sse_response
from opentgi.engine.errors import GenerationError, OverloadedError


def test_event_framing_is_data_colon_compact_json_blank_line():
    assert sse_event({"index": 1, "text": "é \"q\"", "x": None}) == \
        'data:{"index":1,"text":"é \\"q\\"","x":null}\n\n'.encode()


def test_string_payload_is_sent_verbatim():
    assert sse_event("[DONE]") == b"data:[DONE]\n\n"


async def _collect(app) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get("/")


async def test_stream_bytes_and_headers():
    async def events():
        yield {"a": 1}
        yield {"b": [1, 2]}

    async def app(scope, receive, send):
        await sse_response(events(), headers={"x-compute-type": "cpu"})(scope, receive, send)

    response = await _collect(app)
    assert response.status_code == 200
    assert response.content == b'data:{"a":1}\n\ndata:{"b":[1,2]}\n\n'
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-compute-type"] == "cpu"


async def test_error_mid_stream_is_one_tgi_error_event_then_the_end():
    async def events():
        yield {"index": 1}
        raise GenerationError("CUDA out of memory")

    async def app(scope, receive, send):
        await sse_response(events())(scope, receive, send)

    response = await _collect(app)
    assert response.content == (
        b'data:{"index":1}\n\n'
        b'data:{"error":"Request failed during generation: CUDA out of memory","error_type":"generation"}\n\n')


async def test_custom_error_event_shape():
    async def events():
        raise OverloadedError("busy")
        yield {}  # pragma: no cover

    async def app(scope, receive, send):
        await sse_response(events(), error_event=lambda exc: {"message": exc.message})(scope, receive, send)

    assert (await _collect(app)).content == b'data:{"message":"busy"}\n\n'


class FakeHandle:
    def __init__(self):
        self.cancelled = False
        self.done = False

    def cancel(self):
        if not self.done:
            self.cancelled = True


async def test_client_disconnect_closes_the_source_and_cancels_the_handle():
    handle = FakeHandle()
    closed = asyncio.Event()
    first_sent = asyncio.Event()

    async def events():
        try:
            yield {"index": 1}
            await asyncio.sleep(3600)  # the engine is slow: nothing more to write for a long time
            yield {"index": 2}
        finally:
            closed.set()

    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    disconnected = asyncio.Event()

    async def receive():
        if messages:
            return messages.pop(0)
        await disconnected.wait()
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)
        if message.get("body"):
            first_sent.set()

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/", "headers": []}
    task = asyncio.create_task(sse_response(events(), handle=handle)(scope, receive, send))
    await asyncio.wait_for(first_sent.wait(), 5)
    disconnected.set()
    await asyncio.wait_for(task, 5)
    assert closed.is_set()
    assert handle.cancelled
    assert sent[1]["body"] == b'data:{"index":1}\n\n'


async def test_a_finished_handle_is_not_cancelled():
    handle = FakeHandle()

    async def events():
        yield {"index": 1}
        handle.done = True

    async def app(scope, receive, send):
        await sse_response(events(), handle=handle)(scope, receive, send)

    await _collect(app)
    assert not handle.cancelled


async def test_idle_stream_gets_keep_alive_comments():
    async def events():
        yield {"index": 1}
        await asyncio.sleep(0.35)  # e.g. waiting in the queue
        yield {"index": 2}

    async def app(scope, receive, send):
        await sse_response(events(), keep_alive_s=0.1)(scope, receive, send)

    content = (await _collect(app)).content
    assert content.startswith(b'data:{"index":1}\n\n:\n\n')
    assert content.endswith(b':\n\ndata:{"index":2}\n\n')
    assert content.count(b":\n\n") >= 2


def test_a_named_event_has_its_event_line():
    from opentgi.api.sse import NamedEvent, sse_event

    assert sse_event(NamedEvent("message_stop", {"type": "message_stop", "text": "é"})) == \
        'event: message_stop\ndata: {"type":"message_stop","text":"é"}\n\n'.encode()
