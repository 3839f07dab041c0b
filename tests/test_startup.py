"""Start-up as a user sees it: `text-generation-launcher` (which runs `opentgi serve`'s start-up) in a
subprocess on the tiny Llama folder; no warnings on stderr, the links to open printed, the server
answering with the flags given."""

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conformance.live import free_port, wait_until_healthy
from tests.helpers import tiny_models

pytestmark = pytest.mark.slow  # `text-generation-launcher` as a real process: its start-up and its output

ROOT = Path(__file__).resolve().parents[1]
# `nox -s serve` installs the package alone, without httpx2 (which only the test extra's openai pulls
# in): Starlette then warns when Connexion imports its test client. Hide httpx2 to start as that user.
AS_A_FRESH_INSTALL = "import sys; sys.modules['httpx2'] = None; "


def _run_until_healthy(argv, port, timeout_s=180):
    env = {**os.environ, "PYTHONWARNINGS": "default", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}", timeout_s)
        info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    return info, stderr


def test_text_generation_launcher_serves_a_model_folder_quietly_and_prints_its_links():
    """One server start (they are slow on 2 cores): the launcher runs `opentgi serve`'s own start-up."""
    scripts = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[project.scripts]")[1]
    target = re.search(r'^text-generation-launcher = "([\w.:]+)"', scripts, re.M).group(1)
    module, _, function = target.partition(":")
    port = free_port()
    # The console script pip writes calls `target`; the checkout's declaration is what is tested here.
    code = AS_A_FRESH_INSTALL + f"from {module} import {function}; sys.exit({function}())"
    argv = [sys.executable, "-W", "default", "-c", code, "--model-id", str(tiny_models.tiny_llama_path()),
            "--port", str(port), "--max-input-length", "100", "--num-threads", "1"]
    info, stderr = _run_until_healthy(argv, port)
    assert info.status_code == 200, stderr
    assert info.json()["max_input_tokens"] == 100  # TGI's legacy flag name
    assert not re.search(r"\w*Warning\b", stderr), stderr
    assert f"API: http://localhost:{port}" in stderr
    assert f"Swagger UI: http://localhost:{port}/docs" in stderr
    assert f"chat page: http://localhost:{port}/" in stderr
    assert "deterministic: a greedy request gets the same tokens" in stderr  # the default mode
    assert info.json()["deterministic"] is True
    assert "Adding spec json" not in stderr  # Connexion's line per document
