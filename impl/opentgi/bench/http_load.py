"""The load a benchmark drives: prompts of known token counts, TGI `/generate_stream` requests at a
fixed concurrency (time to first token, inter-token latency, throughput), and an `opentgi serve` in a
child process on loopback to drive them against."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

FILLER = ("The history of the city is long and full of surprises. Merchants came from distant lands, "
          "bringing spices, cloth and stories; scholars wrote about the rivers, the bridges and the "
          "markets, and every generation added a new chapter to the tale. ")
PROMPT_TOKENS = (16, 64, 256)  # cycled over the requests of a level


@dataclass
class RequestTiming:
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    ttft: list[float]
    itl: list[float]
    errors: int

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


# --- prompts ---------------------------------------------------------------------------------------


def make_prompt(tokenizer, num_tokens: int, prefix: str = "") -> str:
    ids = tokenizer(prefix + FILLER * (num_tokens // 30 + 2), add_special_tokens=False)["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


# --- the HTTP side ---------------------------------------------------------------------------------


async def stream_one(client, url: str, prompt: str, new_tokens: int, adapter_id: str | None = None) -> RequestTiming:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "do_sample": False}}
    if adapter_id is not None:
        body["parameters"]["adapter_id"] = adapter_id
    timing = RequestTiming(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/generate_stream", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    timing.error = event["error"]
                    return timing
                timing.token_times.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a benchmark reports failures, it does not stop
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def run_level(url: str, prompts: list[str], concurrency: int, num_requests: int, new_tokens: int,
                    time_limit_s: float, adapters: list[str] = ()) -> LevelResult:
    """`adapters`: LoRA adapters the requests cycle through (none: the base model)."""
    import httpx

    timings: list[RequestTiming] = []
    next_index = 0
    deadline = time.perf_counter() + time_limit_s

    async def worker(client) -> None:
        nonlocal next_index
        while next_index < num_requests and time.perf_counter() < deadline:
            prompt = prompts[next_index % len(prompts)]
            adapter = adapters[next_index % len(adapters)] if adapters else None
            next_index += 1
            timings.append(await stream_one(client, url, prompt, new_tokens, adapter))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    ok = [t for t in timings if t.error is None]
    return LevelResult(
        concurrency=concurrency, requests=len(ok), tokens=sum(len(t.token_times) for t in ok), wall_s=wall,
        ttft=[t.ttft for t in ok if t.ttft is not None], itl=[x for t in ok for x in t.itls],
        errors=len(timings) - len(ok))


async def prefix_ttft(url: str, prompt: str) -> tuple[float, float]:
    """TTFT of a prompt never seen before (cold), then of the same prompt again (warm)."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        cold = await stream_one(client, url, prompt, 2)
        warm = await stream_one(client, url, prompt, 2)
    if cold.error or warm.error:
        raise RuntimeError(f"prefix-cache requests failed: {cold.error or warm.error}")
    return cold.ttft, warm.ttft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(args):
    """`opentgi serve` in a child process on loopback; yields its URL once /health answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "opentgi", "serve", "--hostname", "127.0.0.1", "--port", str(port)]
    if args.model_id:
        cmd += ["--model-id", args.model_id]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    cmd += args.server_arg
    # the server's log goes to a file: a pipe nobody reads fills up (64 KiB) and blocks the server
    log_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if proc.poll() is not None:
                log_file.seek(0)
                raise RuntimeError(f"the server exited ({proc.returncode}): {log_file.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy in time")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
