"""Graceful shutdown: on SIGTERM (or the first Ctrl-C) stop admitting, let the requests in flight
finish for up to --shutdown-timeout, then end the rest with an error in their dialect's shape (a
stream's last event, or a 503), and exit 0.

    server = GracefulServer(uvicorn.Config(app, ...), drain=app_drain, shutdown_timeout=30)
    server.run()

`Drain` is the app's side: `draining` turns new generation requests and health checks into 503s;
`cut()` resolves at the deadline, and the request path (`api/generation.py`) then ends the requests
still running. uvicorn itself stops listening, closes idle connections and waits for the busy ones.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

log = logging.getLogger(__name__)

# uvicorn waits this much longer than the drain, so that requests ended at the deadline can write
# their last event and close before it cancels anything.
CLOSE_MARGIN_S = 5.0


class Drain:
    def __init__(self):
        self.draining = False
        self.started_at: float | None = None
        self._cut: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _event(self) -> asyncio.Event:
        if self._cut is None:
            self._cut = asyncio.Event()
        return self._cut

    def begin(self, timeout_s: float) -> None:
        """Stop admitting now; cut what is still running in `timeout_s` (call on the event loop)."""
        if self.draining:
            return
        self.draining = True
        self.started_at = time.monotonic()
        log.info("shutting down: no new requests; in-flight ones have %g s to finish", timeout_s)
        self._timer = asyncio.get_running_loop().call_later(max(timeout_s, 0.0), self._event().set)

    @property
    def is_cut(self) -> bool:
        return self._cut is not None and self._cut.is_set()

    async def cut(self) -> None:
        """Returns at the drain's deadline (never, while the server is not shutting down)."""
        await self._event().wait()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the drain above: a signal starts it instead of ending the process by
    that signal once uvicorn is done (uvicorn re-raises it: the exit status would not be 0)."""

    def __init__(self, config: uvicorn.Config, *, drain: Drain, shutdown_timeout: float):
        config.timeout_graceful_shutdown = shutdown_timeout + CLOSE_MARGIN_S
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: uvicorn's force exit (Ctrl-C twice)
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.drain.begin, self.shutdown_timeout)
        self.should_exit = True
