"""The load a benchmark drives: prompts of known token counts, TGI `/generate_stream` requests at a
fixed concurrency (time to first token, inter-token latency, throughput), the tenants scenario's late
tenant behind a flood (`late_tenant_comparison`), and an `opentgi serve` in a child process on
loopback to drive them against."""

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
from statistics import median

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


async def stream_one(client, url: str, prompt: str, new_tokens: int, adapter_id: str | None = None,
                     headers: dict[str, str] | None = None) -> RequestTiming:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "do_sample": False}}
    if adapter_id is not None:
        body["parameters"]["adapter_id"] = adapter_id
    timing = RequestTiming(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/generate_stream", json=body, headers=headers) as response:
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


# --- a late tenant behind a flood (docs/tenants.md) -----------------------------------------------

LATE_TENANT_FILE = """tenants:
  - {name: alpha, keys: [sk-bench-alpha], weight: 1}
  - {name: beta, keys: [sk-bench-beta], weight: 1}
  - {name: warmup, keys: [sk-bench-warmup], weight: 1}
"""
ALPHA = {"Authorization": "Bearer sk-bench-alpha"}
BETA = {"Authorization": "Bearer sk-bench-beta"}
WARMUP = {"Authorization": "Bearer sk-bench-warmup"}  # its service does not count against alpha's or beta's


async def late_tenant(url: str, alpha_prompt: str, beta_prompt: str, flood: bool, alpha_in_flight: int = 16,
                      alpha_tokens: int = 16, beta_requests: int = 3, beta_tokens: int = 32,
                      delay_s: float = 0.5, beta_headers: dict[str, str] = BETA) -> list[RequestTiming]:
    """Beta's requests, one after another, `delay_s` after alpha starts keeping `alpha_in_flight`
    greedy requests of `alpha_tokens` in flight (each re-sent as it returns); `flood=False`: beta
    alone (an idle server). Alpha's requests are cancelled once beta is done."""
    import httpx

    async def alpha_worker(client) -> None:
        while True:
            timing = await stream_one(client, url, alpha_prompt, alpha_tokens, headers=ALPHA)
            if timing.error:
                raise RuntimeError(f"alpha's request failed: {timing.error}")

    limits = httpx.Limits(max_connections=alpha_in_flight + 4, max_keepalive_connections=alpha_in_flight + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        workers = [asyncio.create_task(alpha_worker(client)) for _ in range(alpha_in_flight if flood else 0)]
        try:
            await asyncio.sleep(delay_s if flood else 0.0)
            beta = []
            for _ in range(beta_requests):
                timing = await stream_one(client, url, beta_prompt, beta_tokens, headers=beta_headers)
                if timing.error or not timing.token_times:
                    raise RuntimeError(f"beta's request failed: {timing.error}")
                for w in workers:  # an alpha failure is the benchmark's failure
                    if w.done():
                        w.result()
                beta.append(timing)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return beta


PROMPT_PREFIXES = ("", "Beta asks: ", "Chapter two. ", "Notes from the archive: ", "A traveller wrote: ",
                   "In the old harbour, ", "Once more: ", "Summary of the lecture: ")


async def full_length_prompts(url: str, candidates: list[str], lengths: tuple[int, ...]) -> list[str]:
    """For each length, the first candidate whose greedy answer runs the whole length (no early
    end of sequence), so that every request of the scenario computes the tokens it names."""
    import httpx

    chosen = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for n in lengths:
            for prompt in candidates:
                if prompt in chosen:
                    continue
                timing = await stream_one(client, url, prompt, n, headers=WARMUP)
                if timing.error is None and len(timing.token_times) == n:
                    chosen.append(prompt)
                    break
            else:
                raise RuntimeError(f"no candidate prompt runs {n} greedy tokens without ending")
    return chosen


def latency(timing: RequestTiming) -> float:
    return timing.token_times[-1] - timing.sent_at


def late_tenant_comparison(args, tokenizer, machine: str) -> str:
    """The tenants scenario on two `--max-batch-size 1` servers, one with `--tenants`
    (alpha and beta, weight 1 each) and one without (first-come): beta's latencies idle, then
    behind alpha's flood; each server's median ratio to its own idle median, as markdown. The flood
    comes first on a fresh server, warmed up by a third tenant: beta's own service in the last 60 s
    would otherwise count against it (docs/tenants.md); beta's idle latencies are taken after it."""
    import copy

    candidates = [make_prompt(tokenizer, 16, prefix=p) for p in PROMPT_PREFIXES]
    alpha_prompt = beta_prompt = None
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as tenants_file:
        tenants_file.write(LATE_TENANT_FILE)
        tenants_file.flush()
        rows = []
        for name, extra in (("tenants, weight 1 each", ["--tenants", tenants_file.name]), ("first-come (no --tenants)", [])):
            server_args = copy.copy(args)
            server_args.server_arg = list(args.server_arg) + ["--max-batch-size", "1"] + extra
            with local_server(server_args) as url:
                if beta_prompt is None:  # greedy and the same model: the same prompts serve both servers
                    alpha_prompt, beta_prompt = asyncio.run(full_length_prompts(url, candidates, (16, 32)))
                asyncio.run(late_tenant(url, alpha_prompt, beta_prompt, flood=False, beta_requests=1,
                                        beta_headers=WARMUP))
                loaded = asyncio.run(late_tenant(url, alpha_prompt, beta_prompt, flood=True))
                time.sleep(2.0)  # alpha's cancelled requests leave the batch
                idle = asyncio.run(late_tenant(url, alpha_prompt, beta_prompt, flood=False))
            idle_s, loaded_s = [latency(t) for t in idle], [latency(t) for t in loaded]
            tokens = sorted({len(t.token_times) for t in idle + loaded})
            print(f"{name}: beta idle {idle_s}, behind alpha {loaded_s} (s); tokens {tokens}", flush=True)
            rows.append(f"| {name} | {', '.join(f'{x:.2f}' for x in idle_s)} | "
                        f"{', '.join(f'{x:.2f}' for x in loaded_s)} | {median(loaded_s) / median(idle_s):.1f}x |")
    return "\n".join([
        f"Late tenant behind a flood: `--max-batch-size 1`; alpha keeps 16 greedy requests of 16 new tokens "
        f"in flight (re-sent as each returns); 0.5 s later beta sends 3 requests of 32, one after another. "
        f"{machine}.", "",
        "| server | beta idle (s) | beta behind alpha (s) | median / idle median |", "|---|---|---|---:|", *rows])


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
