"""The soak: a live `opentgi serve` process under minutes of mixed traffic on every dialect, then a
SIGTERM with requests in flight. `python -m nox -s soak` (or `python -m conformance.soak`).

Traffic (CONCURRENCY clients, for DURATION seconds): TGI /generate, /generate_stream and POST /,
OpenAI chat and completions (streamed or not), LightLLM /generate and /generate_stream, SenseNova
(streamed or not), grammar requests (TGI's json and regex grammars, OpenAI's json_schema), bad inputs
(NaN, huge integers, no Content-Type, a body past --payload-limit, a lone surrogate, out-of-range
parameters, a grammar past the bounds) and clients that leave at a random moment.

It asserts, and prints:
  * 0 answers with a 5xx status (or a stream's error event),
  * 0 KV blocks held once the traffic has stopped (opentgi_kv_blocks_used),
  * no request lost: every request its client did not cut got a complete answer (bad inputs: a 4xx),
  * resident memory flat across the second half (the last tenth within RSS_SLACK of the first tenth),
  * exit status 0 after SIGTERM, the requests then in flight completed.

Uses the tiny random-weight Llama the test suite builds (seconds), unless --model-id is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

RSS_SLACK_BYTES = 32 << 20  # growth allowed across the second half (allocator noise, caches warming)
RSS_SLACK_FRACTION = 0.05
PAYLOAD_LIMIT = 200_000


@dataclass
class Tally:
    by_kind: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # complete, bad_input_refused, cut_by_client, ...
    server_errors: list = field(default_factory=list)  # (kind, status, text)
    lost: list = field(default_factory=list)  # (kind, why)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# --- the traffic ----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
CHAT = [{"role": "user", "content": "Say hello"}]


def generation_requests(rng: random.Random) -> list[tuple[str, str, dict, str]]:
    """(kind, path, body, how the answer is checked)."""
    n = rng.randint(4, 48)
    text = rng.choice(["Hello", "The quick brown fox", "Once upon a time", "1, 2, 3,"])
    return [
        ("tgi generate", "/generate", {"inputs": text, "parameters": {"max_new_tokens": n}}, "tgi"),
        ("tgi stream", "/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": n}}, "tgi_sse"),
        ("tgi compat", "/", {"inputs": text, "parameters": {"max_new_tokens": n}}, "tgi_list"),
        ("tgi compat stream", "/", {"inputs": text, "stream": True, "parameters": {"max_new_tokens": n}}, "tgi_sse"),
        ("tgi best_of", "/generate", {"inputs": text, "parameters": {"max_new_tokens": n, "best_of": 2,
                                                                     "do_sample": True}}, "tgi"),
        ("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": n}, "chat"),
        ("chat stream", "/v1/chat/completions", {"messages": CHAT, "max_tokens": n, "stream": True}, "openai_sse"),
        ("completions", "/v1/completions", {"prompt": [text, text + "!"], "max_tokens": n, "n": 2,
                                            "temperature": 0.8, "seed": rng.randint(0, 9)}, "completions"),
        ("completions stream", "/v1/completions", {"prompt": text, "max_tokens": n, "stream": True}, "openai_sse"),
        ("lightllm generate", "/lightllm/generate", {"inputs": text, "parameters": {"max_new_tokens": n}},
         "lightllm"),
        ("lightllm stream", "/lightllm/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": n}},
         "lightllm_sse"),
        ("sensenova", "/v1/llm/completions", {"model": "m", "prompt": text, "max_new_tokens": n}, "sensenova"),
        ("sensenova stream", "/v1/llm/completions", {"model": "m", "prompt": text, "max_new_tokens": n,
                                                     "stream": True}, "sensenova_sse"),
        ("anthropic", "/v1/messages", {"model": "m", "max_tokens": n, "messages": CHAT}, "anthropic"),
        ("anthropic stream", "/v1/messages", {"model": "m", "max_tokens": n, "messages": CHAT, "stream": True},
         "anthropic_sse"),
        ("responses", "/v1/responses", {"input": text, "max_output_tokens": n}, "responses"),
        ("responses stream", "/v1/responses", {"input": text, "max_output_tokens": n, "stream": True},
         "responses_sse"),
        ("tgi json grammar", "/generate", {"inputs": text, "parameters": {
            "max_new_tokens": 40, "grammar": {"type": "json", "value": SCHEMA}}}, "tgi"),
        ("tgi regex grammar", "/generate", {"inputs": text, "parameters": {
            "max_new_tokens": 12, "grammar": {"type": "regex", "value": r"[a-z]{1,6}-\d{2}"}}}, "tgi"),
        ("chat json_schema", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}, "chat"),
    ]


def bad_requests(rng: random.Random) -> list[tuple[str, str, bytes, dict]]:
    """(kind, path, raw body, headers): each must be refused with a 4xx."""
    json_header = {"content-type": "application/json"}
    return [
        ("bad NaN", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
         json_header),
        ("bad huge int", "/generate", b'{"inputs": "x", "parameters": {"seed": ' + b"9" * 5000 + b"}}", json_header),
        ("bad no content-type", "/lightllm/generate", b'{"inputs": "x"}', {}),
        ("bad too large", "/v1/llm/completions", json.dumps({"model": "m", "prompt": "x" * (PAYLOAD_LIMIT + 10)}
                                                            ).encode(), json_header),
        ("bad surrogate", "/generate", b'{"inputs": "\\ud800"}', json_header),
        ("bad range", "/generate", b'{"inputs": "x", "parameters": {"temperature": -1}}', json_header),
        ("bad grammar", "/generate", json.dumps({"inputs": "x", "parameters": {"grammar": {
            "type": "json", "value": {"type": "object", "properties": {f"p{i}": {} for i in range(300)}}}}}).encode(),
         json_header),
        ("bad json", "/v1/completions", b'{"prompt": "x", ', json_header),
        ("bad image", "/v1/messages", json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]}).encode(),
         json_header),
        ("bad tool type", "/v1/responses", b'{"input": "x", "tools": [{"type": "web_search"}]}', json_header),
    ]


def complete(check: str, response: httpx.Response, text: str) -> str | None:
    """None when the answer is complete, else why not."""
    try:
        if check == "tgi":
            return None if "generated_text" in json.loads(text) else "no generated_text"
        if check == "tgi_list":
            return None if "generated_text" in json.loads(text)[0] else "no generated_text"
        if check in ("chat", "completions"):
            body = json.loads(text)
            return None if body["choices"] and all(c["finish_reason"] for c in body["choices"]) else "no finish"
        if check == "lightllm":
            return None if "generated_text" in json.loads(text) else "no generated_text"
        if check == "sensenova":
            return None if json.loads(text)["data"]["choices"] else "no choices"
        if check == "anthropic":
            return None if json.loads(text)["stop_reason"] else "no stop_reason"
        if check == "responses":
            return None if json.loads(text)["status"] in ("completed", "incomplete") else "not finished"
        events = [line[5:].strip() for line in text.split("\n") if line.startswith("data:")]
        if not events:
            return "empty stream"
        payloads = [json.loads(e) for e in events if e != "[DONE]"]
        if any("error" in p for p in payloads):
            return f"error event {payloads[-1]}"
        if check == "tgi_sse":
            return None if payloads[-1].get("generated_text") is not None else "no final event"
        if check == "openai_sse":
            return None if events[-1] == "[DONE]" else "no [DONE]"
        if check == "lightllm_sse":
            return None if payloads[-1].get("finished") else "not finished"
        if check == "sensenova_sse":
            return None if events[-1] == "[DONE]" else "no [DONE]"
        if check == "anthropic_sse":
            return None if payloads[-1]["type"] == "message_stop" else "no message_stop"
        if check == "responses_sse":
            return None if payloads[-1]["type"] in ("response.completed", "response.incomplete") else "not finished"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"unreadable answer: {exc!r}: {text[:200]}"
    return f"unknown check {check}"


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally, cut_fraction: float,
                      bad_fraction: float = 0.12) -> None:
    if rng.random() < bad_fraction:
        kind, path, raw, headers = rng.choice(bad_requests(rng))
        tally.by_kind[kind] += 1
        response = await client.post(path, content=raw, headers=headers)
        if response.status_code >= 500:
            tally.server_errors.append((kind, response.status_code, response.text[:300]))
        elif 400 <= response.status_code < 500:
            tally.outcomes["bad input refused"] += 1
        else:
            tally.lost.append((kind, f"bad input answered {response.status_code}"))
        return
    kind, path, body, check = rng.choice(generation_requests(rng))
    tally.by_kind[kind] += 1

    async def run() -> tuple[httpx.Response, str]:
        async with client.stream("POST", path, json=body) as response:
            chunks = [chunk async for chunk in response.aiter_text()]
            return response, "".join(chunks)

    cut_after = rng.uniform(0.0, 0.6) if rng.random() < cut_fraction else None
    try:
        response, text = await asyncio.wait_for(run(), cut_after) if cut_after is not None else await run()
    except TimeoutError:
        tally.outcomes["cut by client"] += 1
        return
    except httpx.HTTPError as exc:  # no answer at all (a hang ends in the client's timeout)
        tally.lost.append((kind, f"no answer: {exc!r}"))
        return
    if response.status_code >= 500:
        tally.server_errors.append((kind, response.status_code, text[:300]))
        return
    if response.status_code != 200:
        tally.lost.append((kind, f"status {response.status_code}: {text[:200]}"))
        return
    why = complete(check, response, text)
    if why is None:
        tally.outcomes["complete"] += 1
    elif "error event" in why:
        tally.server_errors.append((kind, 200, why))
    else:
        tally.lost.append((kind, why))


async def traffic(url: str, duration_s: float, concurrency: int, seed: int, tally: Tally,
                  cut_fraction: float = 0.15) -> None:
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await one_request(client, rng, tally, cut_fraction)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def kv_blocks_used(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("opentgi_kv_blocks_used "):
            return float(line.split()[1])
    raise RuntimeError("no opentgi_kv_blocks_used in /metrics")


# --- the run ---------------------------------------------------------------------------------------


def start_server(model_id: str, port: int, shutdown_timeout: float, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "opentgi", "serve", "--model-id", model_id, "--hostname", "127.0.0.1",
               "--port", str(port), "--max-input-tokens", "256", "--max-total-tokens", "512",
               "--max-batch-total-tokens", "16384", "--payload-limit", str(PAYLOAD_LIMIT), "--disable-ui",
               "--shutdown-timeout", str(shutdown_timeout), "--num-threads", "1"]
    return subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("the server exited at start-up (see its log)")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


async def sample_rss(pid: int, samples: list[tuple[float, int]], stop: asyncio.Event, every_s: float = 1.0) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), rss_bytes(pid)))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def soak(url: str, process: subprocess.Popen, duration_s: float, concurrency: int, seed: int,
               shutdown_timeout: float) -> dict:
    tally = Tally()
    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(process.pid, samples, stop))
    began = time.monotonic()
    await traffic(url, duration_s, concurrency, seed, tally)
    stop.set()
    await sampler
    traffic_s = time.monotonic() - began

    # once the traffic has stopped, nothing holds a KV block (cut requests included)
    await asyncio.sleep(1.0)
    blocks = kv_blocks_used(url)

    # SIGTERM with requests in flight (one per client, sent just before): they finish within the
    # drain and the server exits 0
    final = Tally()
    rng = random.Random(seed + 1)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        in_flight = [asyncio.create_task(one_request(client, rng, final, cut_fraction=0.0, bad_fraction=0.0))
                     for _ in range(concurrency)]
        await asyncio.sleep(0.5)
        sigterm_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        await asyncio.gather(*in_flight)
    exit_status = await asyncio.to_thread(process.wait, shutdown_timeout + 30)
    exit_s = time.monotonic() - sigterm_at

    half = [rss for t, rss in samples if t - began >= traffic_s / 2]
    tenth = max(1, len(half) // 10)
    rss_start = sum(half[:tenth]) / tenth
    rss_end = sum(half[-tenth:]) / tenth
    in_flight_at_sigterm = sum(final.by_kind.values())
    final_lost = final.lost
    return {
        "traffic_s": round(traffic_s, 1),
        "requests": sum(tally.by_kind.values()),
        "by_kind": dict(sorted(tally.by_kind.items())),
        "outcomes": dict(tally.outcomes),
        "server_errors_5xx": len(tally.server_errors),
        "server_error_samples": tally.server_errors[:5],
        "lost": len(tally.lost),
        "lost_samples": tally.lost[:5],
        "kv_blocks_used_after_traffic": blocks,
        "rss_second_half_start_mib": round(rss_start / 2**20, 1),
        "rss_second_half_end_mib": round(rss_end / 2**20, 1),
        "rss_samples": len(samples),
        "sigterm_in_flight_completed": final.outcomes["complete"],
        "sigterm_requests_seen": in_flight_at_sigterm,
        "sigterm_5xx": len(final.server_errors),
        "sigterm_lost": len(final_lost),
        "sigterm_samples": (final.server_errors + final_lost)[:5],
        "exit_status": exit_status,
        "exit_after_sigterm_s": round(exit_s, 1),
    }


def verdict(report: dict) -> list[str]:
    failures = []
    if report["server_errors_5xx"] or report["sigterm_5xx"]:
        failures.append(f"5xx answers: {report['server_errors_5xx']} + {report['sigterm_5xx']} at SIGTERM")
    if report["kv_blocks_used_after_traffic"] != 0:
        failures.append(f"{report['kv_blocks_used_after_traffic']:g} KV blocks held after the traffic stopped")
    if report["lost"] or report["sigterm_lost"]:
        failures.append(f"requests lost: {report['lost']} + {report['sigterm_lost']} at SIGTERM")
    growth = report["rss_second_half_end_mib"] - report["rss_second_half_start_mib"]
    allowed = max(RSS_SLACK_BYTES / 2**20, RSS_SLACK_FRACTION * report["rss_second_half_start_mib"])
    if growth > allowed:
        failures.append(f"resident memory grew {growth:.1f} MiB across the second half (allowed {allowed:.1f})")
    if report["exit_status"] != 0:
        failures.append(f"exit status {report['exit_status']} after SIGTERM")
    return failures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of traffic (default 180)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model-id", help="default: the test suite's tiny random-weight Llama")
    parser.add_argument("--shutdown-timeout", type=float, default=20.0)
    parser.add_argument("--server-log", default="soak-server.log", help="where the server's output goes")
    args = parser.parse_args(argv)
    model_id = args.model_id
    if model_id is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.helpers.tiny_models import tiny_llama_path

        model_id = str(tiny_llama_path())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.abspath(args.server_log)
    with open(log_path, "w", encoding="utf-8") as log:
        process = start_server(model_id, port, args.shutdown_timeout, log)
        try:
            wait_healthy(url, process)
            report = asyncio.run(soak(url, process, args.duration, args.concurrency, args.seed,
                                      args.shutdown_timeout))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    print(f"server log: {log_path}")
    print(json.dumps(report, indent=2))
    failures = verdict(report)
    print(f"soak: {report['requests']} requests in {report['traffic_s']} s, "
          f"{report['server_errors_5xx']} x 5xx, {report['lost']} lost, "
          f"{report['kv_blocks_used_after_traffic']:g} KV blocks held after, RSS second half "
          f"{report['rss_second_half_start_mib']} -> {report['rss_second_half_end_mib']} MiB, "
          f"SIGTERM: {report['sigterm_in_flight_completed']} in flight completed, exit status "
          f"{report['exit_status']} after {report['exit_after_sigterm_s']} s")
    if failures:
        raise SystemExit("soak FAILED: " + "; ".join(failures))
    print("soak passed")


if __name__ == "__main__":
    main()
