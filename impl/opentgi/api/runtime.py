"""What handlers reach at request time: the settings and the engine of the app serving the request.

`create_app` builds one `ServerState` and wraps the app in `StateMiddleware`, which binds that state
to a context variable for the duration of each request (tasks a request starts inherit it). There is
no module-level engine: two apps in one process (as in tests) each see their own.

    from opentgi.api import runtime
    engine = runtime.engine()
    settings = runtime.settings()
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentgi.api.engine_client import EngineClient
from opentgi.api.server.shutdown import Drain
from opentgi.config import Settings

_current: ContextVar[ServerState] = ContextVar("opentgi_server_state")


@dataclass
class ServerState:
    settings: Settings
    engine: EngineClient
    metrics: Any = None  # opentgi.metrics.Metrics of this app
    started_at: float = field(default_factory=time.monotonic)
    last_success_at: float | None = None  # monotonic time of the last generation that succeeded
    drain: Drain = field(default_factory=Drain)  # graceful shutdown (api/server/shutdown.py)
    responses: Any = None  # the Responses API's stored responses (api/responses/store.py), made on first use
    tenants: Any = None  # api/tenants/ledger.TenantLedger when the server has keys, else None

    def record_success(self) -> None:
        self.last_success_at = time.monotonic()


def bind(state: ServerState):
    """Make `state` current (returns the token for `unbind`); the middleware does this per request."""
    return _current.set(state)


def unbind(token) -> None:
    _current.reset(token)


def state() -> ServerState:
    try:
        return _current.get()
    except LookupError:
        raise RuntimeError("no opentgi app is serving this request (runtime.bind was not called)") from None


def engine() -> EngineClient:
    return state().engine


def settings() -> Settings:
    return state().settings


def metrics():
    """This app's opentgi.metrics.Metrics (a state made without one, as in handler tests, gets its own)."""
    current = state()
    if current.metrics is None:
        from opentgi.metrics import Metrics

        current.metrics = Metrics()
    return current.metrics


class StateMiddleware:
    """ASGI middleware: binds the app's ServerState for each request and gives every scope an
    `extensions` dict, so Connexion's routing information reaches the error handlers."""

    def __init__(self, app, *, server_state: ServerState):
        self.app = app
        self.server_state = server_state

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            scope.setdefault("extensions", {})
        token = _current.set(self.server_state)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)
