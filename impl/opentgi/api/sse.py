"""The one Server-Sent Events helper every dialect streams through.

Framing as TGI's axum server writes it: `data:{json}\\n\\n` (no space after the colon), compact JSON,
`Content-Type: text/event-stream`, `X-Accel-Buffering: no` (so nginx does not buffer the stream).
A `NamedEvent` adds its `event:` line as Anthropic's and OpenAI Responses' streams have it:
`event: NAME\\ndata: {json}\\n\\n`.
An error while streaming becomes one last event in the dialect's error shape, then the stream ends.
An idle stream gets axum's keep-alive, an empty comment (`:\n\n`) every 15 s.
A client that goes away cancels the stream: the event source is closed at once (its `finally` runs,
which cancels the engine handle), not when the next token would have been written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class NamedEvent:
    """An event with a name: `event: NAME` before its `data:` line."""

    name: str
    data: Mapping[str, Any]


# An event source yields dicts (JSON-encoded into one event each), str (sent as the data verbatim,
# e.g. OpenAI's closing "[DONE]") or NamedEvents.
Event = Mapping[str, Any] | str | NamedEvent
ErrorEvent = Callable[[BaseException], Event]


def tgi_error_event(exc: BaseException) -> Mapping[str, Any]:
    """The default last event: TGI's `{"error": ..., "error_type": ...}`."""
    from opentgi.api.errors import tgi_error

    return tgi_error(exc).body


def dumps(payload: Any) -> str:
    """Compact JSON as serde_json writes it: no spaces, non-ASCII kept as is."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sse_event(payload: Event) -> bytes:
    # a lone surrogate (JSON's "\ud800" escape in a request, echoed back) has no UTF-8: written as
    # the same JSON escape instead of failing the stream
    if isinstance(payload, NamedEvent):
        return f"event: {payload.name}\ndata: {dumps(payload.data)}\n\n".encode("utf-8", "backslashreplace")
    data = payload if isinstance(payload, str) else dumps(payload)
    return f"data:{data}\n\n".encode("utf-8", "backslashreplace")


KEEP_ALIVE_S = 15.0  # axum's KeepAlive default: an empty comment after 15 s without an event
KEEP_ALIVE = b":\n\n"


async def _frame(events: AsyncIterator[Event], error_event: ErrorEvent,
                 keep_alive_s: float | None = KEEP_ALIVE_S) -> AsyncIterator[bytes]:
    """Frame each event; a comment line keeps an idle stream (a long queue wait) open through proxies."""
    iterator = events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keep_alive_s)
            if not done:
                yield KEEP_ALIVE
                continue
            finished, pending = pending, None
            try:
                payload = finished.result()
            except StopAsyncIteration:
                return
            yield sse_event(payload)
    except Exception as exc:  # noqa: BLE001 - every error becomes the stream's last event
        yield sse_event(error_event(exc))
    finally:
        if pending is not None:  # closed while waiting for the next event: stop the source first
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await _aclose(events)


async def _aclose(events: AsyncIterator[Event]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client going away and then closes its source."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[Event], *, error_event: ErrorEvent = tgi_error_event,
                 handle=None, status_code: int = 200, headers: Mapping[str, str] | None = None,
                 keep_alive_s: float | None = KEEP_ALIVE_S):
        self._events = events
        self._handle = handle
        # Given explicitly, so Starlette does not append "; charset=utf-8" (axum sends it bare).
        all_headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        all_headers.update(headers or {})
        super().__init__(_frame(events, error_event, keep_alive_s), status_code=status_code, headers=all_headers,
                         media_type=self.media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        log.info("client disconnected while streaming")
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self.body_iterator)
                await _aclose(self._events)
            if self._handle is not None:
                self._handle.cancel()  # a no-op once the request is done


def sse_response(events: AsyncIterator[Event], *, error_event: ErrorEvent = tgi_error_event, handle=None,
                 headers: Mapping[str, str] | None = None, keep_alive_s: float | None = KEEP_ALIVE_S) -> SSEResponse:
    """Stream `events` as SSE.

    `error_event(exc)` is the last event when the source raises (default: TGI's error shape);
    `handle` (an engine RequestHandle) is cancelled when the stream closes before it is done.
    """
    return SSEResponse(events, error_event=error_event, handle=handle, headers=headers, keep_alive_s=keep_alive_s)
