"""A client that goes away cancels its generation (streaming or not), over a real uvicorn server."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from opentgi.api.app import create_app
from opentgi.config import Settings
from opentgi.engine.engine import Engine

LONG = 200  # tokens a full generation would take


@pytest.fixture(scope="module")
def server(tiny_llama):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings(model_id=str(tiny_llama), device="cpu", max_input_tokens=32, max_total_tokens=256,
                        max_batch_total_tokens=2048)
    engine = Engine.from_settings(settings)
    config = uvicorn.Config(create_app(settings, engine), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine, port
    uv.should_exit = True
    thread.join(30)


def wait_idle(engine, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stats().requests_in_flight:
        assert time.monotonic() < deadline, "the request is still in flight"
        time.sleep(0.02)


def body(stream: bool = False) -> dict:
    return {"inputs": "Hello", "parameters": {"max_new_tokens": LONG, "details": True}, **(
        {"stream": True} if stream else {})}


def test_a_full_generation_takes_all_its_tokens(server):
    url, engine, _ = server
    response = httpx.post(url + "/generate", json=body(), timeout=120)
    assert response.json()["details"]["generated_tokens"] == LONG  # the premise of the tests below


def test_closing_a_stream_cancels_the_generation(server):
    url, engine, _ = server
    steps_before = engine.stats().steps_total
    with httpx.stream("POST", url + "/generate_stream", json={"inputs": "Hello", "parameters": {
            "max_new_tokens": LONG}}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                assert json.loads(line[5:])["index"] == 1
                break
    wait_idle(engine)
    assert engine.stats().steps_total - steps_before < LONG // 2


def test_leaving_a_generate_request_cancels_it(server):
    url, engine, port = server
    steps_before = engine.stats().steps_total
    payload = json.dumps(body()).encode()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 20
        while not engine.stats().requests_in_flight:  # the request reached the engine
            assert time.monotonic() < deadline
            time.sleep(0.005)
    wait_idle(engine)
    assert engine.stats().steps_total - steps_before < LONG // 2
