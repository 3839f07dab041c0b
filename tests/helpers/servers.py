"""`opentgi serve` as a child process: start it, wait until it answers, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 16  # chunked prefill: prompts longer than this are prefilled over several steps


SERVER_FLAGS = ["--chunked-prefill-tokens", str(CHUNK), "--num-threads", "1", "--max-batch-total-tokens", "4096",
                "--dtype", "float32"]



# --- a live 2-shard server against one shard -----------------------------------------------------
def spawn_server(model: Path, port: int, *flags: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "impl"), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "opentgi.cli", "serve", "--model-id", str(model),
                             "--port", str(port), "--hostname", "127.0.0.1", *flags],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/info", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not start")


def stop(proc: subprocess.Popen) -> None:
    """A server still running gets SIGINT, then its process group SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
