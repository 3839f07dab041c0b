"""`pytest conformance --server-url URL` runs the live-server tests against a running server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conformance.live import LIVE_MAX_INPUT_TOKENS, LIVE_MAX_TOTAL_TOKENS, free_port, serve
from opentgi.config import Settings

pytestmark = pytest.mark.slow  # a nested pytest run against a server of another process

ROOT = Path(__file__).resolve().parents[1]


def request_count(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^tgi_request_count (\S+)$", metrics, re.M).group(1))


def test_conformance_tests_talk_to_the_given_server(tiny_llama):
    settings = Settings(model_id=str(tiny_llama), hostname="127.0.0.1", port=free_port(),
                        max_input_tokens=LIVE_MAX_INPUT_TOKENS, max_total_tokens=LIVE_MAX_TOTAL_TOKENS,
                        max_batch_total_tokens=16 * LIVE_MAX_TOTAL_TOKENS)
    with serve(settings) as url:
        before = request_count(url)
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--server-url", url,
             "conformance/test_tgi_clients.py::test_generate_details_and_finish_reason_contract"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "1 passed" in run.stdout
        assert request_count(url) > before  # the test's requests reached this server, not one of its own


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The OS may offer a port again before the server it went to has bound it: free_port skips
    the ports it handed out already."""
    from conformance import live

    offered = iter([41001, 41001, 41002])

    class Probe:
        def __init__(self, *args):
            self.port = next(offered)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(live, "_handed_out", set())
    monkeypatch.setattr(live.socket, "socket", Probe)
    assert [live.free_port(), live.free_port()] == [41001, 41002]
