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
`--late-tenant` (the tenants scenario: a late tenant's latency behind another's flood, with
`--tenants` and first-come, against idle: `http_load.late_tenant_comparison`),
`--architectures A,...` (each family at the default model's shape beside Llama:
`bench/architectures.py`) and `--speculate N` (speculative decoding on a
code-editing workload, single stream, side by side with a plain server: `bench/speculate.py`).
The in-process parts load the model with the server's own flags (`--server-arg`). This module is
the command line; the load is `http_load.py`, the baselines `baselines.py`, the tables `report.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid
from pathlib import Path

from opentgi.bench.baselines import bare_forward_loop, hf_serial_generate
from opentgi.bench.http_load import (
    PROMPT_TOKENS,
    LevelResult,
    local_server,
    make_prompt,
    prefix_ttft,
    run_level,
)
from opentgi.bench.lora import lora_comparison
from opentgi.bench.report import machine_line, percentile, report
from opentgi.bench.shards import shard_comparison


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
    p.add_argument("--late-tenant", action="store_true", help="only the tenants comparison: beta's latency "
                   "behind alpha's 16 requests in flight on --max-batch-size 1, with --tenants and first-come")
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


def _report(text: str, output: str | None) -> None:
    """A comparison's table on stdout, and appended to `--output` when given."""
    print()
    print(text)
    if output:
        with Path(output).open("a") as f:
            f.write("\n" + text)


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
    if args.late_tenant:
        from opentgi.bench.http_load import late_tenant_comparison

        text = late_tenant_comparison(args, tokenizer, f"{loaded.model_id}, {machine_line(args.num_threads)}")
        return _report(text, args.output)
    if args.architectures:
        from opentgi.bench.architectures import architecture_comparison, engine_step_comparison

        if args.engine_steps:
            # on this (serial) thread, as the server runs its event loop: an engine's team of torch
            # threads is then the only one (a loading thread's team ends with it)
            text = engine_step_comparison(args, prompts, server_settings, machine_line, own_thread)
        else:
            text = own_thread(lambda: architecture_comparison(args, prompts, local_server, run_level, machine_line))
        return _report(text, args.output)
    if args.lora or args.shards or args.speculate:
        if args.lora or args.shards:
            text = own_thread(lambda: lora_comparison(args, loaded, prompts) if args.lora
                              else shard_comparison(args, loaded, prompts))
        else:
            from opentgi.bench.speculate import speculate_comparison

            text = own_thread(lambda: speculate_comparison(args, loaded, local_server, machine_line))
        return _report(text, args.output)
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
