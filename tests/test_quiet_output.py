"""A real `opentgi serve` process prints only opentgi's own log lines from start-up to exit: no
third-party warnings at start-up and no native library's leak report at exit, whether it is
stopped with Ctrl-C (SIGINT) or SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from conformance.live import free_port, wait_until_healthy

pytestmark = pytest.mark.slow  # a real `opentgi serve` process and the signals that stop it

# configure_logging's format: "2026-11-24 03:01:23,934 INFO opentgi.request: ..."
OUR_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) (opentgi|uvicorn)[\w.]*: ")


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_start_and_stop_print_only_our_own_lines(tiny_llama, stop_signal):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "opentgi", "serve", "--model-id", str(tiny_llama), "--device", "cpu",
         "--hostname", "127.0.0.1", "--port", str(port), "--max-batch-total-tokens", "4096",
         "--num-threads", "1", "--disable-ui", "--shutdown-timeout", "5"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(process, url)
        response = httpx.post(url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                              timeout=60)
        assert response.status_code == 200
        process.send_signal(stop_signal)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert stdout == ""
    lines = [line for line in stderr.splitlines() if line.strip()]
    foreign = [line for line in lines if not OUR_LINE.match(line)]
    assert foreign == [], "\n".join(foreign[:20])
    assert any("shutting down" in line for line in lines)
