"""A client that goes away cancels its generation, on every generating route of every dialect,
streaming or not, over a real uvicorn server: the engine stops stepping once the client has left.

Each case sends a request for LONG tokens over a raw socket, waits until the engine has run a few
steps of it, closes the socket, and then counts the engine's steps until it is idle (nothing running,
nothing waiting). A route that does not cancel keeps stepping to the end of the LONG tokens.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from conformance.live import free_port, serve
from opentgi.config import Settings

LONG = 300  # tokens a full generation would take
STEPS_BEFORE_LEAVING = 3
# After the client left, the engine may finish the step it is in and the next one or two (the
# disconnect reaches the loop thread between steps); far fewer than the LONG tokens left.
STEPS_AFTER_LEAVING = 40

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": LONG, "temperature": 1.0, "seed": 1}
ROUTES = {
    "tgi generate": ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": LONG}}),
    "tgi generate_stream": ("/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": LONG}}),
    "tgi compat": ("/", {"inputs": "Hello", "parameters": {"max_new_tokens": LONG}}),
    "tgi compat stream": ("/", {"inputs": "Hello", "parameters": {"max_new_tokens": LONG}, "stream": True}),
    "chat": ("/v1/chat/completions", CHAT),
    "chat stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
    "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": LONG, "seed": 1}),
    "completions stream": ("/v1/completions", {"prompt": "Hello", "max_tokens": LONG, "seed": 1, "stream": True}),
    "lightllm generate": ("/lightllm/generate", {"inputs": "Hello", "parameters": {
        "max_new_tokens": LONG, "ignore_eos": True}}),
    "lightllm generate_stream": ("/lightllm/generate_stream", {"inputs": "Hello", "parameters": {
        "max_new_tokens": LONG, "ignore_eos": True}}),
    "sensenova": ("/v1/llm/completions", {"model": "m", "prompt": "Hello", "max_new_tokens": LONG}),
    "sensenova stream": ("/v1/llm/completions", {"model": "m", "prompt": "Hello", "max_new_tokens": LONG, "stream": True}),
    "anthropic messages": ("/v1/messages", {"model": "m", "max_tokens": LONG, "messages": CHAT["messages"]}),
    "anthropic messages stream": ("/v1/messages", {"model": "m", "max_tokens": LONG, "messages": CHAT["messages"],
                                                   "stream": True}),
    "responses": ("/v1/responses", {"input": "Hello", "max_output_tokens": LONG}),
    "responses stream": ("/v1/responses", {"input": "Hello", "max_output_tokens": LONG, "stream": True}),
}


@pytest.fixture(scope="module")
def server(tiny_llama):
    port = free_port()
    settings = Settings(model_id=str(tiny_llama), device="cpu", max_input_tokens=128, max_total_tokens=512,
                        max_batch_total_tokens=4096, hostname="127.0.0.1", port=port)
    from opentgi.api import app as app_module

    engines = []
    original = app_module.create_app

    def capture(settings, engine, **kwargs):  # the live server's engine, to read its stats
        engines.append(engine)
        return original(settings, engine, **kwargs)

    app_module.create_app = capture
    try:
        with serve(settings) as url:
            yield url, engines[0], port
    finally:
        app_module.create_app = original


def idle(engine) -> bool:
    stats = engine.stats()
    return stats.running == 0 and stats.waiting == 0 and stats.requests_in_flight == 0


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_full_generation_takes_all_its_tokens(server):
    url, _, _ = server
    response = httpx.post(url + "/generate", json={"inputs": "Hello", "parameters": {
        "max_new_tokens": LONG, "details": True}}, timeout=120)
    assert response.json()["details"]["generated_tokens"] == LONG  # the premise of the tests below


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_that_leaves_stops_the_engine(server, route):
    url, engine, port = server
    path, body = ROUTES[route]
    wait_for(lambda: idle(engine))
    payload = json.dumps(body).encode()
    steps_at_start = engine.stats().steps_total
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_for(lambda: engine.stats().steps_total - steps_at_start >= STEPS_BEFORE_LEAVING)
        assert engine.stats().running == 1  # still generating when the client leaves
        steps_at_leaving = engine.stats().steps_total
    wait_for(lambda: idle(engine))
    steps_after = engine.stats().steps_total - steps_at_leaving
    assert steps_after < STEPS_AFTER_LEAVING, f"{route}: the engine ran {steps_after} steps after the client left"
    assert engine.stats().used_blocks == 0
