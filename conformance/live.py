"""Serving the real app in a background thread for the live tests: one way, used by every suite."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from opentgi.config import Settings

# Small limits: every request stays cheap, and the limits themselves get exercised.
LIVE_MAX_INPUT_TOKENS = 192
LIVE_MAX_TOTAL_TOKENS = 256


_handed_out: set[int] = set()  # ports this process gave a server that may not have bound them yet


def free_port() -> int:
    """A port free now and never handed out before by this process: a test that picks ports for
    several servers before any binds (a spawned one takes seconds) gets a different one each time."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def wait_until_healthy(process, url: str, timeout_s: float = 120) -> None:
    """Wait for a server process started by a test (subprocess.Popen) to answer /health with 200;
    fail with its output if it exits first or takes longer than `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"the server exited: {process.communicate()}"
        assert time.monotonic() < deadline, "the server did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@contextlib.contextmanager
def serve(settings: Settings, *, startup_timeout_s: float = 300) -> Iterator[str]:
    """Engine + app (with its metrics) for `settings`, served by uvicorn on settings.hostname:port;
    yields the base URL and shuts the server down afterwards."""
    import uvicorn

    from opentgi.api.app import create_app
    from opentgi.engine.engine import Engine
    from opentgi.metrics import Metrics

    metrics = Metrics()
    engine = Engine.from_settings(settings, observer=metrics.observer)
    app = create_app(settings, engine, metrics=metrics)
    config = uvicorn.Config(app, host=settings.hostname, port=settings.port, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{settings.hostname}:{settings.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
