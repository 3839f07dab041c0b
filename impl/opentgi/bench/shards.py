"""`--shards K,...`: throughput at each concurrency level for 1, 2, ... tensor-parallel shards."""

from __future__ import annotations

import argparse
import asyncio
import time

from opentgi.bench.http_load import PROMPT_TOKENS, local_server, run_level
from opentgi.bench.report import machine_line, percentile


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
