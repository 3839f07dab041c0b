"""The benchmark's report: the machine it ran on and the markdown tables of the main run."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from pathlib import Path

from opentgi.bench.http_load import PROMPT_TOKENS, LevelResult


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]



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
