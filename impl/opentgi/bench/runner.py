"""Benchmark (not a test): `python -m opentgi.bench [--url http://127.0.0.1:8080]`.

In one run, on one machine:
1. the server (started here on loopback unless --url is given) is driven through TGI's
   `/generate_stream` at concurrency 1, 4, 16, 64 (greedy, --new-tokens each, mixed prompt lengths,
   bounded in requests and time): throughput, time to first token and inter-token latency;
2. a warm-vs-cold prefix-cache TTFT for a repeated ~1,000-token prompt;
3. baselines in this process on the same model: serial transformers `generate`, and a bare loop of
   the paged model's own forward with its KV cache (no scheduler, no sampler, no HTTP);
4. where a decode step's time goes, on an engine in this process (`bench/steps.py`);
5. with `--peer NAME=URL` (repeatable): the same `/v1/completions` load against opentgi and each
   peer in turn, with tokens/s, resident memory and opentgi's ratios (`bench/peers.py`);
then prints the numbers and the ratios as markdown tables (`--output FILE` also appends them to FILE).
Separate modes: `--lora K,...` (adapters mixed; with `--shards N`, one value, on an N-shard
server), `--shards K,...` (tensor parallelism),
`--architectures A,...` (each family at the default model's shape beside Llama:
`bench/architectures.py`) and `--speculate N` (speculative decoding on a
code-editing workload, single stream, side by side with a plain server: `bench/speculate.py`).
The in-process parts load the model with the server's own flags (`--server-arg`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


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


# --- in-process baselines --------------------------------------------------------------------------


def hf_serial_generate(folder: Path, tokenizer, prompts: list[str], new_tokens: int) -> tuple[float, int]:
    """(tokens/s, tokens) of transformers `generate`, one request after the other, greedy."""
    import torch

    from opentgi.models.loader import load_transformers_model

    model = load_transformers_model(folder, torch.float32)
    eos = model.generation_config.eos_token_id
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=tokenizer.eos_token_id)
            tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - started), tokens


def bare_forward_loop(loaded, tokenizer, prompt: str, new_tokens: int) -> float:
    """Decode tokens/s of the paged model's forward + greedy argmax in a plain loop."""
    import torch

    from opentgi.engine.execution.kv_cache import allocate_kv_caches
    from opentgi.engine.scheduling.block_manager import BlockManager
    from opentgi.models.attention.metadata import AttentionMetadata

    model, spec = loaded.model, loaded.spec
    block_size = loaded.block_size
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    total = len(ids) + new_tokens
    num_blocks = BlockManager(1, block_size).blocks_for(total)
    kv = allocate_kv_caches(spec, num_blocks, block_size)
    device = torch.device(spec.device)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0)

    def meta(start: int, n: int) -> AttentionMetadata:
        i32 = {"dtype": torch.int32, "device": device}
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + n, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor([0, n], **i32), cu_seqlens_k=torch.tensor([0, start + n], **i32),
            max_seqlen_q=n, max_seqlen_k=start + n, context_lens=torch.tensor([start + n], **i32),
            block_tables=table, decode_only=n == 1)

    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids, device=device), torch.arange(len(ids), device=device),
                               meta(0, len(ids)), kv)
        token = model.compute_logits(hidden[-1:]).argmax(-1)
        started = time.perf_counter()
        for pos in range(len(ids), total - 1):
            hidden = model.forward(token, torch.tensor([pos], device=device), meta(pos, 1), kv)
            token = model.compute_logits(hidden).argmax(-1)
            int(token)  # the engine needs the token on the host each step too
        elapsed = time.perf_counter() - started
    return (new_tokens - 1) / elapsed


# --- report ----------------------------------------------------------------------------------------


def machine_line(threads: int | None) -> str:
    import torch
    import transformers

    from opentgi import __version__

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {device}; torch threads {threads or torch.get_num_threads()}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, opentgi {__version__}")


def report(levels: list[LevelResult], hf_tps: float, bare_tps: float, cold: float, warm: float,
           args, model_name: str, extra: list[str] = ()) -> str:
    by_c = {lv.concurrency: lv for lv in levels}
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {model_name}",
        "",
        f"Machine: {machine_line(args.num_threads)}.",
    ]
    if levels:
        lines += [
            (f"Greedy, {args.new_tokens} new tokens, prompts of {'/'.join(map(str, PROMPT_TOKENS))} tokens, "
             f"TGI `/generate_stream` over loopback HTTP."),
            "",
            "| concurrency | requests | tokens | tokens/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for lv in levels:
        lines.append(f"| {lv.concurrency} | {lv.requests} | {lv.tokens} | {lv.throughput:.1f} | "
                     f"{percentile(lv.ttft, 50):.3f} | {percentile(lv.ttft, 99):.3f} | "
                     f"{percentile(lv.itl, 50) * 1e3:.1f} | {percentile(lv.itl, 99) * 1e3:.1f} |"
                     + (f" ({lv.errors} errors)" if lv.errors else ""))
    lines += ["", "| measure | value |", "|---|---:|"]
    if hf_tps:
        lines.append(f"| serial transformers `generate` (tokens/s) | {hf_tps:.1f} |")
    if bare_tps:
        lines.append(f"| bare paged forward loop, decode (tokens/s) | {bare_tps:.1f} |")
    lines += [f"| prefix cache, ~1,000-token prompt: cold TTFT (s) | {cold:.3f} |",
              f"| prefix cache, same prompt again: warm TTFT (s) | {warm:.3f} |"]
    ratios = []
    if 16 in by_c and hf_tps:
        ratios.append(f"| concurrency 16 throughput / serial `generate` | {by_c[16].throughput / hf_tps:.2f}x |")
    if 1 in by_c and bare_tps and by_c[1].itl:
        decode_tps = 1.0 / statistics.median(by_c[1].itl)
        ratios.append(f"| concurrency 1 decode (1 / ITL p50) / bare forward loop | {decode_tps / bare_tps:.2f}x |")
    if cold:
        ratios.append(f"| warm / cold prefix TTFT | {warm / cold:.2f}x |")
    lines += ratios
    lines += extra
    return "\n".join(lines) + "\n"


# --- LoRA adapters mixed in one batch ----------------------------------------------------------------


def write_random_adapters(config, folder: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT LoRA adapters of `rank` on all seven projections of every layer (a
    mixture-of-experts layer: q/k/v/o, every expert's gate/up/down and the router), written in
    PEFT's own format (adapter_config.json + adapter_model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    from opentgi.models.families.layout import DecoderLayout
    from opentgi.models.families.structure import FAMILIES
    from opentgi.models.lora import ROUTER, TARGET_MODULES, module_shapes, num_experts, shape_key
    from opentgi.models.registry import PAGED_ARCHITECTURES, architecture_of

    shapes = module_shapes(config)
    parts = FAMILIES[PAGED_ARCHITECTURES[architecture_of(config)][0]]
    moe = DecoderLayout.of(config, parts).moe
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    experts = [f"experts.{e}.{name}" for e in range(num_experts(config)) for name in parts.expert_names]
    targets = list(TARGET_MODULES) + ([*parts.expert_names, ROUTER] if any(moe) else [])
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            modules = [*attention, *experts, ROUTER] if moe[layer] else list(TARGET_MODULES)
            for module in modules:
                fan_in, fan_out = shapes[shape_key(module)]
                owner = "self_attn" if module in attention else parts.mlp_attr
                key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
        out = folder / f"lora{i}"
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(set(targets)),
            "bias": "none", "base_model_name_or_path": getattr(config, "_name_or_path", None)}))
        paths.append(out)
    return paths


def lora_op_timings(config, num_adapters: int, rank: int, num_tokens: int,
                    repeats: int = 20) -> tuple[float, float, float]:
    """Median ms of every layer's LoRA deltas for one step of `num_tokens` tokens spread over
    `num_adapters` adapters, side by side on the same random weights: (LoraLinear's row-invariant
    form, served by default; its stacked form, served with --nondeterministic; the per-token gather
    as punica's BGMV)."""
    import torch

    from opentgi.models.lora import GROUPS, LoraLinear, LoraState, bgmv_delta, module_shapes

    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(0)
    names = [f"l{i}" for i in range(num_adapters)]
    state = LoraState(names, rank, torch.bfloat16, torch.device("cpu"))
    state.begin_step([names[i % num_adapters] for i in range(num_tokens)], [1] * num_tokens)
    slots = state.step.token_slots
    layers = []
    for _, modules in GROUPS.values():
        fan_in, outs = shapes[modules[0]][0], [shapes[m][1] for m in modules]
        a = torch.randn(num_adapters, len(modules), rank, fan_in, generator=gen) / fan_in ** 0.5
        b = [torch.randn(num_adapters, rank, out, generator=gen) * 0.01 for out in outs]
        base = lambda x, n=sum(outs): x.new_zeros(x.shape[0], n)  # noqa: E731 - the delta alone
        layers.append((LoraLinear(base, state, a, b, row_invariant=True), LoraLinear(base, state, a, b),
                       a.bfloat16(), [p.bfloat16() for p in b],
                       torch.randn(num_tokens, fan_in, generator=gen).bfloat16()))

    def timed(fn) -> float:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(config.num_hidden_layers):
                for layer in layers:
                    fn(*layer)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs) * 1e3

    with torch.inference_mode():
        invariant = timed(lambda inv, stacked, a, b, x: inv(x))
        stacked = timed(lambda inv, stacked, a, b, x: stacked(x))
        gather = timed(lambda inv, stacked, a, b, x: torch.cat([bgmv_delta(x, a[:, p], b[p], slots)
                                                                for p in range(len(b))], dim=1))
    return invariant, stacked, gather


def lora_comparison(args, loaded, prompts: list[str]) -> str:
    """Throughput at one concurrency with 0, 1, ... adapters mixed, side by side on one server (every
    adapter loaded), in interleaved rounds; returns the markdown table."""
    counts = [int(x) for x in args.lora.split(",")]
    c = args.lora_concurrency
    shards = int(args.shards) if args.shards else 1  # parse_args allows one value with --lora
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(loaded.hf_config, Path(tmp), max(counts), args.lora_rank)
        names = [p.name for p in paths]
        server_args = argparse.Namespace(**vars(args))
        server_args.server_arg = [*args.server_arg, "--lora-adapters", ",".join(f"{p.name}={p}" for p in paths),
                                  *(["--num-shard", str(shards)] if shards > 1 else [])]
        totals = {k: [0, 0.0, 0, 0] for k in counts}  # tokens, wall, requests, errors
        rounds: dict[int, list[float]] = {k: [] for k in counts}
        with local_server(server_args) as url:
            asyncio.run(run_level(url, prompts[:1], 1, 1, 4, args.level_time_limit, names))  # warm-up
            for round_ in range(args.lora_rounds):
                for k in counts:
                    # a fresh prefix on every prompt: no level is helped by the prefix cache
                    unique = [f"{uuid.uuid4().hex[:8]} {p}" for p in (prompts * c)[:c]]
                    lv = asyncio.run(run_level(url, unique, c, c, args.new_tokens, args.level_time_limit,
                                               names[:k]))
                    t = totals[k]
                    t[0] += lv.tokens
                    t[1] += lv.wall_s
                    t[2] += lv.requests
                    t[3] += lv.errors
                    rounds[k].append(lv.throughput)
                    print(f"round {round_ + 1}, {k} adapters: {lv.throughput:.1f} tokens/s", flush=True)
    base_median = statistics.median(rounds[counts[0]])
    ops = {k: lora_op_timings(loaded.hf_config, k, args.lora_rank, c) for k in counts if k}
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — LoRA adapters mixed, {loaded.model_id}"
        + (f", --num-shard {shards}" if shards > 1 else ""),
        "",
        f"Machine: {machine_line(args.num_threads)}.",
        (f"One server with {max(counts)} random rank-{args.lora_rank} adapters on every projection (q/k/v/o, "
         "gate/up/down; in a mixture-of-experts layer each expert's and the router) loaded; "
         f"concurrency {c}, greedy, {args.new_tokens} new tokens, prompts of "
         f"{'/'.join(map(str, PROMPT_TOKENS))} tokens each with a fresh prefix (no prefix-cache hits), "
         f"requests cycling through the first k adapters (k = 0: the base model); {args.lora_rounds} "
         f"interleaved rounds of {c} requests each."),
        "",
        "| adapters mixed | requests | tokens | tokens/s (all rounds) | tokens/s (median round) "
        "| time per token vs base (median rounds) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for k in counts:
        tokens, wall, requests, errors = totals[k]
        tps = tokens / wall if wall else 0.0
        median = statistics.median(rounds[k])
        lines.append(f"| {k} | {requests} | {tokens} | {tps:.1f} | {median:.1f} | {base_median / median:.2f}x |"
                     + (f" ({errors} errors)" if errors else ""))
    from opentgi.models.lora import num_experts

    dense_only = " (the dense projections' shapes; not the experts')" if num_experts(loaded.hf_config) else ""
    lines += ["", f"The LoRA delta alone, every layer of one {c}-token decode step{dense_only} (median ms, "
              "same weights):", "",
              "| adapters mixed | per adapter, row-invariant (served) | stacked (--nondeterministic) "
              "| per-token gather (punica BGMV in torch) |",
              "|---:|---:|---:|---:|"]
    lines += [f"| {k} | {invariant:.2f} | {stacked:.2f} | {gather:.2f} |"
              for k, (invariant, stacked, gather) in ops.items()]
    return "\n".join(lines) + "\n"


def shard_comparison(args, loaded, prompts: list[str]) -> str:
    """Throughput at each concurrency level for 1, 2, ... tensor-parallel shards (`--num-shard`), one
    server at a time (they share the machine), in interleaved rounds; returns the markdown table."""
    counts = [int(x) for x in args.shards.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    totals = {(k, c): [0, 0.0, 0, 0, []] for k in counts for c in levels}  # tokens, wall, requests, errors, ITLs
    for round_ in range(args.rounds):
        for k in counts:
            server_args = argparse.Namespace(**vars(args))
            server_args.server_arg = [*args.server_arg, "--num-shard", str(k)]
            with local_server(server_args) as url:
                asyncio.run(run_level(url, prompts[:1], 1, 1, 4, args.level_time_limit))  # warm-up
                for c in levels:
                    n = min(args.max_requests, max(4, 2 * c))
                    lv = asyncio.run(run_level(url, prompts, c, n, args.new_tokens, args.level_time_limit))
                    t = totals[(k, c)]
                    t[0] += lv.tokens
                    t[1] += lv.wall_s
                    t[2] += lv.requests
                    t[3] += lv.errors
                    t[4] += lv.itl
                    print(f"round {round_ + 1}, {k} shards, concurrency {c}: {lv.throughput:.1f} tokens/s",
                          flush=True)
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — tensor parallelism, {loaded.model_id}",
        "",
        f"Machine: {machine_line(args.num_threads)}.",
        (f"`--num-shard k` servers one after another (CPU: gloo; each rank gets cores / k torch threads "
         f"unless --num-threads is given), greedy, {args.new_tokens} new tokens, prompts of "
         f"{'/'.join(map(str, PROMPT_TOKENS))} tokens, {args.rounds} interleaved rounds summed."),
        "",
        "| shards | concurrency | requests | tokens | tokens/s | ITL p50 (ms) | tokens/s vs 1 shard |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in levels:
        base = totals[(counts[0], c)]
        base_tps = base[0] / base[1] if base[1] else 0.0
        for k in counts:
            tokens, wall, requests, errors, itl = totals[(k, c)]
            tps = tokens / wall if wall else 0.0
            lines.append(f"| {k} | {c} | {requests} | {tokens} | {tps:.1f} | {percentile(itl, 50) * 1e3:.1f} | "
                         f"{tps / base_tps if base_tps else 0:.2f}x |" + (f" ({errors} errors)" if errors else ""))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m opentgi.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server (default: start one on loopback)")
    p.add_argument("--model-id", help="model for the local server and the baselines (default model if unset)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (server and baselines)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels ('' = none)")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                   help="another server (OpenAI /v1/completions) to drive side by side; repeatable")
    p.add_argument("--peer-concurrency", default="1,16,64", help="levels of the side-by-side run")
    p.add_argument("--breakdown-concurrency", default="1,16",
                   help="levels of the decode-step breakdown ('' = none)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-requests", type=int, default=64, help="requests per level at most")
    p.add_argument("--level-time-limit", type=float, default=120.0, help="seconds per level at most")
    p.add_argument("--baseline-prompts", type=int, default=6, help="prompts for the serial generate baseline")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `opentgi serve` argument")
    p.add_argument("--output", default="", help="a markdown file to append the tables to ('' = print only)")
    p.add_argument("--lora", help="only the LoRA comparison: comma-separated adapter counts mixed, e.g. 0,1,4")
    p.add_argument("--lora-concurrency", type=int, default=16, help="concurrency of the LoRA comparison")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the random adapters (--lora)")
    p.add_argument("--lora-rounds", type=int, default=5, help="interleaved rounds (--lora)")
    p.add_argument("--shards", help="only the tensor-parallel comparison: comma-separated --num-shard "
                   "values, e.g. 1,2 (at each --concurrency level); with --lora one value: the LoRA "
                   "comparison on a server of that many shards")
    p.add_argument("--architectures", help="only the architecture comparison: comma-separated families at "
                   "the default model's shape with random weights, beside Llama, e.g. qwen3,gemma2 "
                   "(bench/architectures.py)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (--shards, --architectures)")
    p.add_argument("--engine-steps", action="store_true", help="with --architectures: compare the engines' "
                   "decode steps in this process instead of served throughput (bench/architectures.py)")
    p.add_argument("--speculate", type=int, help="only the speculative-decoding comparison: a code-editing "
                   "workload, single stream, a plain server beside one with --speculate N (bench/speculate.py)")
    p.add_argument("--speculate-new-tokens", type=int, default=256, help="new tokens at most (--speculate)")
    p.add_argument("--speculate-rounds", type=int, default=4, help="interleaved rounds (--speculate)")
    args = p.parse_args(argv)
    if args.lora and args.shards and not args.shards.strip().isdigit():
        p.error("--shards with --lora takes one --num-shard value (the LoRA comparison's server)")
    return args


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def server_settings(args):
    """The Settings `opentgi serve` builds from the benchmark's server flags."""
    from opentgi.cli import build_parser, settings_from

    argv = ["serve"] + (["--model-id", args.model_id] if args.model_id else []) + list(args.server_arg)
    if args.num_threads:
        argv += ["--num-threads", str(args.num_threads)]
    return settings_from(build_parser().parse_args(argv), {})


def side_by_side(args, url: str, prompts: list[str]) -> list[str]:
    from opentgi.bench import peers as bench_peers
    servers = [("opentgi", url)] + [bench_peers.parse_peer(p) for p in args.peer]
    levels, rss = [], {}
    for name, server_url in servers:  # each server in turn; the others stay idle
        for c in _levels(args.peer_concurrency):
            lv = asyncio.run(bench_peers.completions_level(name, server_url, prompts, c, max(6, 2 * c),
                                                           args.new_tokens, args.level_time_limit))
            print(f"{name} /v1/completions concurrency {c}: {lv.requests} requests, {lv.tokens} tokens "
                  f"in {lv.wall_s:.1f}s = {lv.throughput:.1f} tokens/s"
                  + (f"; {lv.errors} errors, first: {lv.first_error}" if lv.errors else ""), flush=True)
            levels.append(lv)
        rss[name] = bench_peers.server_rss(server_url)
    lines = ["", f"Side by side, one run, each server in turn (the others idle): `/v1/completions`, greedy, "
             f"{args.new_tokens} new tokens, not streamed, tokens from `usage`.", ""]
    lines += bench_peers.table([n for n, _ in servers], levels, rss)
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    from opentgi.bench import steps as bench_steps
    from opentgi.engine.execution import torch_threads
    from opentgi.models.loader import load_model

    # As in the server (engine/execution/torch_threads.py): this thread runs torch on one thread; loading and
    # the in-process baselines run in threads of their own, the step breakdown's engine in its loop.
    args.num_threads = torch_threads.resolve(args.num_threads)  # the server and the report name it too
    torch_threads.keep_calling_thread_serial()

    def own_thread(fn):
        return torch_threads.call_in_own_thread(fn, args.num_threads, name="opentgi-bench")

    settings = server_settings(args)
    loaded = own_thread(lambda: load_model(settings))
    tokenizer = loaded.tokenizer
    prompts = [make_prompt(tokenizer, n) for n in PROMPT_TOKENS]
    long_prompt = make_prompt(tokenizer, 1000, prefix=f"Session {uuid.uuid4().hex}. ")
    if args.architectures:
        from opentgi.bench.architectures import architecture_comparison, engine_step_comparison

        if args.engine_steps:
            text = own_thread(lambda: engine_step_comparison(args, prompts, server_settings, machine_line))
        else:
            text = own_thread(lambda: architecture_comparison(args, prompts, local_server, run_level, machine_line))
        print()
        print(text)
        if args.output:
            with Path(args.output).open("a") as f:
                f.write("\n" + text)
        return
    if args.lora or args.shards or args.speculate:
        if args.lora or args.shards:
            text = own_thread(lambda: lora_comparison(args, loaded, prompts) if args.lora
                              else shard_comparison(args, loaded, prompts))
        else:
            from opentgi.bench.speculate import speculate_comparison

            text = own_thread(lambda: speculate_comparison(args, loaded, local_server, machine_line))
        print()
        print(text)
        if args.output:
            with Path(args.output).open("a") as f:
                f.write("\n" + text)
        return
    levels: list[LevelResult] = []
    hf_tps = bare_tps = 0.0
    baseline_prompts = (prompts * args.baseline_prompts)[:args.baseline_prompts]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server(args))
        asyncio.run(run_level(url, prompts[:1], 1, 1, 4, args.level_time_limit))  # warm-up
        for c in _levels(args.concurrency):
            n = min(args.max_requests, max(4, 2 * c))
            lv = asyncio.run(run_level(url, prompts, c, n, args.new_tokens, args.level_time_limit))
            print(f"concurrency {c}: {lv.requests} requests, {lv.tokens} tokens in {lv.wall_s:.1f}s = "
                  f"{lv.throughput:.1f} tokens/s; TTFT p50 {percentile(lv.ttft, 50):.3f}s; "
                  f"ITL p50 {percentile(lv.itl, 50) * 1e3:.1f}ms p99 {percentile(lv.itl, 99) * 1e3:.1f}ms"
                  + (f"; {lv.errors} errors" if lv.errors else ""), flush=True)
            levels.append(lv)
            # each baseline runs right after the level it is compared with (the server idle), so
            # that both see the same machine
            if c == 1 and loaded.kind == "paged":  # best of 3: the baseline gets the benefit of doubt
                bare_tps = max(own_thread(lambda: bare_forward_loop(loaded, tokenizer, prompts[0], args.new_tokens))
                               for _ in range(3))
                print(f"bare paged forward loop: {bare_tps:.1f} tokens/s", flush=True)
            if c == 16:
                hf_tps, _ = own_thread(lambda: hf_serial_generate(loaded.folder, tokenizer, baseline_prompts,
                                                                  args.new_tokens))
                print(f"serial transformers generate: {hf_tps:.1f} tokens/s", flush=True)
        cold, warm = asyncio.run(prefix_ttft(url, long_prompt))
        print(f"prefix cache: cold TTFT {cold:.3f}s, warm TTFT {warm:.3f}s", flush=True)
        extra = side_by_side(args, url, prompts) if args.peer else []
    breakdown = []
    if loaded.kind == "paged":
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        for c in _levels(args.breakdown_concurrency):
            breakdown.append(bench_steps.measure(loaded, settings, prompt_ids, c, args.new_tokens))
            parts = ", ".join(f"{k} {v:.2f}" for k, v in breakdown[-1].median_ms.items())
            print(f"decode step at concurrency {c} (ms): {parts}; whole step {breakdown[-1].step_ms:.2f}",
                  flush=True)
    if breakdown:
        extra += ["", f"Where a decode step's time goes ({loaded.spec.dtype}, engine in the benchmark's "
                  "process, medians):", ""] + bench_steps.table(breakdown)
    if not hf_tps and levels:  # --concurrency '': only the side-by-side and the breakdown
        hf_tps, _ = own_thread(lambda: hf_serial_generate(loaded.folder, tokenizer, baseline_prompts,
                                                          args.new_tokens))
        print(f"serial transformers generate: {hf_tps:.1f} tokens/s", flush=True)
    text = report(levels, hf_tps, bare_tps, cold, warm, args, f"{loaded.model_id}, {loaded.spec.dtype}", extra)
    print()
    print(text)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
