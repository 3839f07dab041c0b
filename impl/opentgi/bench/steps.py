"""Where a decode step's time goes (part of the benchmark, `python -m opentgi.bench`).

An engine runs in this process on the benchmark's model and settings; `concurrency` greedy
requests, as `/v1/completions` builds them without `logprobs` (so `needs_logprobs` False), are
submitted at once and decoded to the end. Timers wrap the engine's parts on this one
engine instance (nothing in the engine itself is changed or slowed when not benchmarking), and
each decode-only step (every scheduled row has one new token) is split into:

- schedule: `scheduler.schedule` (batch composition, block allocation);
- prepare: the model runner's step tensors (`ModelRunner.prepare`);
- model: the forward through the decoder layers (with the LM head where one native call computes
  both, `decode_logits`);
- LM head: `compute_logits`;
- sampling: `Sampler.sample`;
- update: `scheduler.update_from_output` (tokens appended, blocks committed);
- detokenize + stop: `OutputProcessor.process` for every row;
- other: the rest of `EngineCore.step` (plan, bookkeeping, observer, finishing);
- delivery: from the step's end to the asyncio side running its deliveries
  (`loop.call_soon_threadsafe`), outside the step.
Medians over the decode steps, in milliseconds per step. Apart from these parts: the native ops'
calls (`torch.ops.opentgi.*`: the layers in `decode_stack`, the head's `gguf_mm`, ...) inside the
model and the LM head, and the host work, the whole step less them (Python, torch's own ops, the
native ops' argument conversion is counted as native here).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

PARTS = ("schedule", "prepare", "model", "LM head", "sampling", "update", "detokenize + stop", "other",
         "delivery")


@dataclass
class StepBreakdown:
    concurrency: int
    steps: int  # decode-only steps measured
    median_ms: dict[str, float] = field(default_factory=dict)  # part -> median ms per step
    step_ms: float = 0.0  # median of the whole EngineCore.step
    native_ms: float = 0.0  # median per step of the native ops' calls
    host_ms: float = 0.0  # median per step of the step less its native ops' calls

    @property
    def tokens_per_s(self) -> float:
        """What the step alone allows (rows per step / step time), delivery excluded."""
        return self.concurrency / (self.step_ms / 1e3) if self.step_ms else 0.0


def _timed(record: dict, part: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[part] = record.get(part, 0.0) + time.perf_counter() - t0
    return wrapper


def _time_native_ops(record: dict):
    """Timers on the loaded native ops (`torch.ops.opentgi`, where the kernels are loaded): their
    calls add up under "native". Returns the function that takes the timers off."""
    import torch

    from opentgi.kernels import native

    ops = torch.ops.opentgi
    names = ("gguf_mm", "gguf_moe_up", "gguf_moe_down", "paged_attention", "rms_norm", "add_rms_norm", "silu_mul",
             "decode_stack", "decode_stack_run")
    taken = [(name, getattr(ops, name)) for name in names if hasattr(ops, name)] if native.loaded() else []
    for name, op in taken:
        setattr(ops, name, _timed(record, "native", op))

    def restore() -> None:
        for name, op in taken:
            setattr(ops, name, op)
    return restore


def measure(loaded, settings, prompts: list[list[int]], concurrency: int, new_tokens: int,
            needs_logprobs: bool = False) -> StepBreakdown:
    """Run `concurrency` greedy requests (prompt token ids cycled from `prompts`) to the end on an
    engine in this process; return the median split of its decode-only steps."""
    return asyncio.run(_measure(loaded, settings, prompts, concurrency, new_tokens, needs_logprobs))


async def _measure(loaded, settings, prompts, concurrency, new_tokens, needs_logprobs) -> StepBreakdown:
    from opentgi.engine.engine import Engine
    from opentgi.engine.execution.model_runner import in_mode
    from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams

    engine = Engine(loaded, settings)
    core = engine.core
    steps: list[dict] = []
    current: dict = {}
    model = core.runner.model
    prepare = core.runner.prepare

    def prepare_noting_decode(seqs, num_new_tokens):
        current["decode"] = all(n == 1 for n in num_new_tokens)
        return prepare(seqs, num_new_tokens)

    core.runner.prepare = prepare_noting_decode
    for owner, name, part in ((core.scheduler, "schedule", "schedule"), (core.runner, "prepare", "prepare"),
                              (model, "forward", "model"), (model, "decode_logits", "model"),
                              (model, "compute_logits", "LM head"),
                              (core.sampler, "sample", "sampling"),
                              (core.scheduler, "update_from_output", "update"),
                              (core.output, "process", "detokenize + stop")):
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        # the model's entries as the runner calls them (in inference mode already: without their own wrapper)
        setattr(owner, name, _timed(current, part, in_mode(fn) if owner is model else fn))
    step, deliver = core.step, engine._deliver

    def timed_step():
        current.clear()
        t0 = time.perf_counter()
        out = step()
        end = time.perf_counter()
        steps.append(dict(current, step=end - t0, ended=end))
        return out

    def timed_deliver(deliveries):
        if steps:
            steps[-1]["delivery"] = time.perf_counter() - steps[-1]["ended"]
        deliver(deliveries)

    core.step, engine._deliver = timed_step, timed_deliver
    untime_native_ops = _time_native_ops(current)
    await engine.start()
    try:
        requests = [GenerationRequest(list(prompts[i % len(prompts)]), SamplingParams(),
                                      StoppingParams(max_new_tokens=new_tokens, ignore_eos=True),
                                      needs_logprobs=needs_logprobs)
                    for i in range(concurrency)]
        handles = [await engine.submit(r) for r in requests]
        await asyncio.gather(*(h.result() for h in handles))
    finally:
        await engine.stop()
        untime_native_ops()
    decode = [s for s in steps if s.get("decode") and "model" in s]
    result = StepBreakdown(concurrency, len(decode))
    if not decode:
        return result
    per_part = defaultdict(list)
    for s in decode:
        inner = sum(s.get(p, 0.0) for p in PARTS if p not in ("other", "delivery"))
        s["other"] = max(0.0, s["step"] - inner)
        for p in PARTS:
            if p in s:
                per_part[p].append(s[p])
    result.median_ms = {p: statistics.median(v) * 1e3 for p, v in per_part.items()}
    result.step_ms = statistics.median(s["step"] for s in decode) * 1e3
    result.native_ms = statistics.median(s.get("native", 0.0) for s in decode) * 1e3
    result.host_ms = statistics.median(s["step"] - s.get("native", 0.0) for s in decode) * 1e3
    return result


def table(results: list[StepBreakdown]) -> list[str]:
    """Markdown: one column per concurrency, ms per decode step."""
    head = "| part (ms per decode step, median) | " + " | ".join(f"c={r.concurrency}" for r in results) + " |"
    lines = [head, "|---|" + "---:|" * len(results)]
    for p in PARTS:
        lines.append(f"| {p} | " + " | ".join(f"{r.median_ms[p]:.2f}" if p in r.median_ms else "-"  # none a step
                                               for r in results) + " |")
    lines.append("| whole engine step | " + " | ".join(f"{r.step_ms:.2f}" for r in results) + " |")
    lines.append("| native ops' calls | " + " | ".join(f"{r.native_ms:.2f}" for r in results) + " |")
    lines.append("| host: the step less them | " + " | ".join(
        f"{r.host_ms:.2f} ({100 * r.host_ms / r.step_ms:.0f}%)" if r.step_ms else "-" for r in results) + " |")
    lines.append("| tokens/s the step allows | " + " | ".join(f"{r.tokens_per_s:.1f}" for r in results) + " |")
    return lines
