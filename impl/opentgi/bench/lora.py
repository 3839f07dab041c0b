"""`--lora K,...`: throughput with 0, 1, ... LoRA adapters mixed in one batch, on one server with
random PEFT adapters, and the cost of the LoRA deltas alone, side by side."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from opentgi.bench.http_load import PROMPT_TOKENS, local_server, run_level
from opentgi.bench.report import machine_line


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
