"""The asyncio side of one request: an async iterator of TokenEvents and the final result.

The engine thread never touches a handle directly: it hands each step's deliveries to the event
loop with `loop.call_soon_threadsafe`, and `_deliver` runs there.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from opentgi.engine.errors import GenerationError
from opentgi.engine.events import GenerationResult, TokenEvent
from opentgi.engine.request import GenerationRequest


class RequestHandle:
    def __init__(self, request: GenerationRequest, on_cancel: Callable[[str], None]):
        self.request = request
        self._on_cancel = on_cancel
        self._events: deque[TokenEvent] = deque()
        self._wakeup = asyncio.Event()  # set by every delivery: wakes the event iterator
        self._ended = asyncio.Event()  # set once: result, error or cancel (what `result` waits for)
        self._result: GenerationResult | None = None
        self._error: Exception | None = None
        self._cancelled = False
        # Whether the consumer reads the events (streams). `result` clears it: from then on the
        # engine hands this handle only its end, not every step's tokens (read by the engine thread).
        self.streams = True
        self.num_generated_tokens = 0  # set when cancelled: the tokens generated until then (usage)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None or self._cancelled

    # --- filled from the event loop by the engine ----------------------------------------------------
    def _deliver(self, events: list[TokenEvent], result: GenerationResult | None, error: Exception | None) -> None:
        if self.done:  # cancelled, or already failed by the watchdog: a late step's output is dropped
            return
        self._events.extend(events)
        if result is not None:
            self._result = result
        if error is not None:
            self._error = error
        self._wakeup.set()
        if self.done:
            self._ended.set()

    # --- consumer side ---------------------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        while True:
            if self._events:
                return self._events.popleft()
            if self._error is not None:
                raise self._error
            if self._result is not None or self._cancelled:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    async def result(self) -> GenerationResult:
        """Waits for the end of generation (dropping any events not yet read). Woken once, at the
        end, not at every step: a non-streamed batch of 64 requests cost the event loop 64 wake-ups
        a step, time taken from the engine's torch threads. Nor is it handed every step's events."""
        self.streams = False
        await self._ended.wait()
        self._events.clear()
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise GenerationError("request was cancelled")
        return self._result

    @property
    def final(self) -> GenerationResult | None:
        """The result once delivered (with the last events), without waiting; else None."""
        return self._result

    def cancel(self) -> None:
        """The client is gone: end its sequences; their KV blocks are freed by the next step."""
        if self.done:
            return
        self._cancelled = True
        self._events.clear()
        self._wakeup.set()
        self._ended.set()
        self._on_cancel(self.request_id)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()
