"""SIGTERM to a real `opentgi serve` process: it stops admitting (503), lets requests in flight finish
within --shutdown-timeout, ends the ones still running with an error in their dialect's shape (a
stream's last event, a JSON 503), and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conformance.live import free_port, wait_until_healthy

pytestmark = pytest.mark.slow  # SIGTERM to a real `opentgi serve` process

SHUTDOWN_TIMEOUT_S = 3.0
# The tiny model's end-of-sequence ids: banned from the long stream, which samples (OpenAI's default
# temperature) and would otherwise end early by chance, some thousand tokens in
EOS_IDS = (0, 2)


@pytest.fixture
def server(tiny_llama):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "opentgi", "serve", "--model-id", str(tiny_llama), "--device", "cpu",
         "--hostname", "127.0.0.1", "--port", str(port), "--max-input-tokens", "64", "--max-total-tokens", "8192",
         "--max-batch-total-tokens", "16384", "--num-threads", "1", "--disable-ui",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(process, url)
    yield url, process
    if process.poll() is None:
        process.kill()
        process.wait()


def sse_events(response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_sigterm_drains_then_cuts_with_an_error_and_exits_zero(server):
    url, process = server
    results: dict[str, object] = {}
    streaming = threading.Event()

    def short_stream():  # finishes well within the drain
        with httpx.stream("POST", url + "/generate_stream", json={"inputs": "Hello", "parameters": {
                "max_new_tokens": 20}}, timeout=60) as response:
            streaming.set()
            time.sleep(0.5)  # still in flight when SIGTERM arrives
            results["short"] = sse_events(response)

    def long_stream():  # cannot finish in SHUTDOWN_TIMEOUT_S
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8000,
                                                                 "stream": True, "logit_bias": {str(i): -100 for i in EOS_IDS}},
                         timeout=60) as response:
            results["long_stream"] = [line for line in response.iter_lines() if line.startswith("data:")]

    def long_plain():
        results["long_plain"] = httpx.post(url + "/lightllm/generate", json={"inputs": "Hello", "parameters": {
            "max_new_tokens": 8000, "ignore_eos": True}}, timeout=60)

    threads = [threading.Thread(target=f) for f in (short_stream, long_stream, long_plain)]
    for thread in threads:
        thread.start()
    assert streaming.wait(30)
    time.sleep(0.3)
    sent_at = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # not admitting: a new request is refused (503) or finds the port closed
        late = httpx.post(url + "/generate", json={"inputs": "Hello"}, timeout=10)
        assert late.status_code == 503, late.text
    except httpx.ConnectError:
        pass
    for thread in threads:
        thread.join(60)
    assert process.wait(60) == 0
    assert time.monotonic() - sent_at < SHUTDOWN_TIMEOUT_S + 5

    short = results["short"]
    assert short[-1]["details"] is None and short[-1]["generated_text"] is not None  # completed normally
    long_stream_lines = results["long_stream"]
    assert long_stream_lines[-1] == "data: [DONE]"
    last = json.loads(long_stream_lines[-2][5:])
    assert last.get("error_type") == "healthcheck" and "shut down" in last["error"], long_stream_lines[-3:]
    plain = results["long_plain"]
    assert plain.status_code == 503
    assert "shut down" in plain.json()["message"]
