"""Side by side with other servers (part of the benchmark, `python -m opentgi.bench --peer NAME=URL`).

The same load goes to opentgi and to every peer in turn, in one run: OpenAI `/v1/completions`
(greedy, `temperature: 0`, not streamed, `max_tokens` new tokens, the benchmark's prompts) at each
concurrency level; tokens are counted from each response's `usage.completion_tokens`, so servers
that stop early at an end-of-sequence token are not credited for tokens they did not generate.
The model name sent is the first one the server lists at `/v1/models` (servers without that route
get "default"). Resident memory is read from /proc for a server listening on this machine: the
process that owns the port and all its descendants (vLLM runs its engine in a child process).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse


@dataclass
class PeerLevel:
    name: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    errors: int
    first_error: str | None = None

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def parse_peer(text: str) -> tuple[str, str]:
    """"NAME=URL" -> (name, url without a trailing slash)."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer wants NAME=http://host:port, got {text!r}")
    return name, url.rstrip("/")


async def served_model(client, url: str) -> str:
    with contextlib.suppress(Exception):
        r = await client.get(f"{url}/v1/models", timeout=10)
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data and data[0].get("id"):
                return data[0]["id"]
    return "default"


async def completions_level(name: str, url: str, prompts: list[str], concurrency: int, num_requests: int,
                            new_tokens: int, time_limit_s: float) -> PeerLevel:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = await served_model(client, url)
        next_index = tokens = done = errors = 0
        first_error: str | None = None
        deadline = time.perf_counter() + time_limit_s

        async def one(prompt: str) -> None:
            nonlocal tokens, done, errors, first_error
            body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
                    "stream": False}
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                tokens += int(r.json()["usage"]["completion_tokens"])
                done += 1
            except Exception as exc:  # noqa: BLE001 - a benchmark reports failures, it does not stop
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"

        async def worker() -> None:
            nonlocal next_index
            while next_index < num_requests and time.perf_counter() < deadline:
                prompt = prompts[next_index % len(prompts)]
                next_index += 1
                await one(prompt)

        await one(prompts[0])  # warm-up, not counted
        tokens = done = errors = 0
        first_error = None
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return PeerLevel(name, concurrency, done, tokens, wall, errors, first_error)


# --- resident memory -------------------------------------------------------------------------------


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def _rss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def process_tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _rss_bytes(p)
        todo.extend(_children(p))
    return total


def listening_pid(port: int) -> int | None:
    """The process (of this user) holding the listening socket on `port`, or None."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    if str(fd.readlink()) in targets:
                        return int(fd_dir.parent.name)
    return None


def server_rss(url: str) -> int | None:
    """Resident bytes of the server behind `url` when it listens on this machine, else None."""
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    pid = listening_pid(parsed.port or (443 if parsed.scheme == "https" else 80))
    return process_tree_rss(pid) if pid is not None else None


# --- report ----------------------------------------------------------------------------------------


def table(names: list[str], levels: list[PeerLevel], rss: dict[str, int | None]) -> list[str]:
    """Markdown: tokens/s per server and level, resident memory, then opentgi's ratio to each peer."""
    cs = sorted({lv.concurrency for lv in levels})
    by = {(lv.name, lv.concurrency): lv for lv in levels}
    lines = ["| server | " + " | ".join(f"c={c} tokens/s" for c in cs) + " | resident memory (MiB) |",
             "|---|" + "---:|" * (len(cs) + 1)]

    def cell(lv: PeerLevel | None) -> str:
        if lv is None:
            return "–"
        return f"{lv.throughput:.1f}" + (f" ({lv.errors} errors)" if lv.errors else "")

    for name in names:
        mem = rss.get(name)
        mem_cell = f"{mem / 2**20:.0f}" if mem else "–"
        lines.append(f"| {name} | " + " | ".join(cell(by.get((name, c))) for c in cs) + f" | {mem_cell} |")
    ours = names[0]
    for name in names[1:]:
        ratios = []
        for c in cs:
            a, b = by.get((ours, c)), by.get((name, c))
            ratios.append(f"{a.throughput / b.throughput:.2f}x" if a and b and b.throughput else "–")
        mem_a, mem_b = rss.get(ours), rss.get(name)
        mem = f"{mem_a / mem_b:.2f}x" if mem_a and mem_b else "–"
        lines.append(f"| {ours} / {name} | " + " | ".join(ratios) + f" | {mem} |")
    return lines
