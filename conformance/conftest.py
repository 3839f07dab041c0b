"""A live server for the conformance suites: the tiny Llama behind the real app, served by uvicorn.

`live_server` is the base URL ("http://127.0.0.1:PORT") of one server per test session, started in
a background thread on a free port. Its limits are small so property tests stay fast on 2 cores.
`live_settings` holds the Settings it runs with.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from opentgi.config import Settings
from tests import tiny_models

torch.set_num_threads(1)  # CI has 2 cores and other suites run beside this one

# Small limits: every request stays cheap, and the limits themselves get exercised.
LIVE_MAX_INPUT_TOKENS = 192
LIVE_MAX_TOTAL_TOKENS = 256


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def live_settings() -> Settings:
    return Settings(
        model_id=str(tiny_models.tiny_llama_path()),
        device="cpu",
        hostname="127.0.0.1",
        port=_free_port(),
        max_input_tokens=LIVE_MAX_INPUT_TOKENS,
        max_total_tokens=LIVE_MAX_TOTAL_TOKENS,
        max_batch_total_tokens=16 * LIVE_MAX_TOTAL_TOKENS,
        max_concurrent_requests=64,
    )


@pytest.fixture(scope="session")
def live_server(live_settings: Settings) -> Iterator[str]:
    import uvicorn

    from opentgi.api.app import create_app
    from opentgi.engine.engine import Engine
    from opentgi.metrics import Metrics

    metrics = Metrics()
    engine = Engine.from_settings(live_settings, observer=metrics.observer)
    app = create_app(live_settings, engine, metrics=metrics)
    config = uvicorn.Config(app, host=live_settings.hostname, port=live_settings.port, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{live_settings.hostname}:{live_settings.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
