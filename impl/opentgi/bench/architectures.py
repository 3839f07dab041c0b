"""`python -m opentgi.bench --architectures llama,qwen3,...`: each family of the paged path at the
default model's shape, side by side with Llama in one run.

Random-weight models of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads of 64, 3 kv heads,
intermediate 1536, tied embeddings, SmolLM2's tokenizer from the default model's GGUF) are built
once per architecture with transformers (bfloat16 safetensors under the cache folder) with what
sets the family apart left at its defaults (Gemma 2's soft-capping, the windows of Gemma, Phi-3
and StarCoder2, Qwen3's q/k norms). Mixtral has 8 experts of 1536 features and Qwen3-MoE 8 of 768,
2 per token. Each architecture is then served beside a Llama server (default flags plus
--server-arg), warmed with one unmeasured round at every level, and the two are driven one right
after the other at each --concurrency level.
The checkpoints are dense, so with default flags no side takes the single-call decode step
(models/families/native_stack.py); `--server-arg=--quantize=int8` puts every projection, experts
included, on the native kernels' blocks, where it does. With `--engine-steps`, instead: each
architecture's engine and Llama's run in this process (`bench/steps.py`), one right after the other
per round and level, and the table compares their median decode steps (the model, the LM head and the engine around them; no HTTP, no client).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

SHAPE = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "intermediate_size": 1536, "max_position_embeddings": 8192, "rope_theta": 100000.0,
         "tie_word_embeddings": True, "initializer_range": 0.02}
# name -> (config class, model class, what the family adds to SHAPE)
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 64}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"query_pre_attn_scalar": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 2047}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"use_bias": True, "sliding_window": 4096,
                                                                "hidden_act": "gelu_pytorch_tanh"}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 768, "norm_topk_prob": True}),
}


def same_shape_model(name: str, cache_dir: str | None) -> Path:
    """The folder of architecture `name` at the default model's shape, built on first use."""
    import torch
    import transformers
    from transformers import GenerationConfig

    from opentgi.models.checkpoints.default_model import default_cache_dir, default_gguf_path
    from opentgi.models.checkpoints.gguf_tokenizer import load_gguf_tokenizer

    config_class, model_class, extra = ARCHITECTURES[name]
    folder = default_cache_dir(cache_dir) / "bench-models" / f"{name}-576x30"
    if (folder / ".complete").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = load_gguf_tokenizer(default_gguf_path())
    tokenizer.save_pretrained(folder)
    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2,
                                                 **{**SHAPE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 0], pad_token_id=2).save_pretrained(folder)
    (folder / ".complete").write_text(name)
    return folder


def architecture_comparison(args, prompts: list[str], local_server, run_level, machine_line) -> str:
    """Each architecture beside a Llama server that stays up throughout: per round and level, the
    two are driven one right after the other (the other idle), so each ratio compares measurements
    taken moments apart on a machine whose load drifts. Returns the markdown table."""
    names = [n.strip() for n in args.architectures.split(",") if n.strip() and n.strip() != "llama"]
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        raise SystemExit(f"--architectures: unknown {unknown}; known: {', '.join(ARCHITECTURES)}")
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    folders = {n: same_shape_model(n, None) for n in ["llama", *names]}
    totals: dict[tuple[str, str, int], list] = {}  # (architecture, server measured, c) -> tokens, s, errors

    def serve(name: str):
        server_args = argparse.Namespace(**vars(args))
        server_args.model_id = str(folders[name])
        return local_server(server_args)

    with serve("llama") as llama_url:
        asyncio.run(run_level(llama_url, prompts[:1], 1, 1, 4, args.level_time_limit))  # warm-up
        for name in names:
            with serve(name) as url:
                # one unmeasured round at every level: the Llama server beside it has served every
                # round so far, and a fresh engine's first few hundred steps are slower (warm-up)
                for c in levels:
                    asyncio.run(run_level(url, prompts, c, min(args.max_requests, max(2, c)), args.new_tokens,
                                          args.level_time_limit))
                for round_ in range(args.rounds):
                    for c in levels:
                        pair = [("llama", llama_url), (name, url)]
                        for server, server_url in pair if round_ % 2 == 0 else pair[::-1]:
                            lv = asyncio.run(run_level(server_url, prompts, c, min(args.max_requests, max(2, c)),
                                                       args.new_tokens, args.level_time_limit))
                            t = totals.setdefault((name, server, c), [0, 0.0, 0])
                            t[0] += lv.tokens
                            t[1] += lv.wall_s
                            t[2] += lv.errors
                            print(f"{name} round {round_ + 1}, {server}, concurrency {c}: "
                                  f"{lv.throughput:.1f} tokens/s", flush=True)
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — architectures at SmolLM2-135M's shape",
             "", f"Machine: {machine_line(args.num_threads)}.",
             (f"Random weights (bfloat16 checkpoints), each architecture served beside a Llama server and "
              f"driven in turn with it (the other idle), default flags"
              f"{' + ' + ' '.join(args.server_arg) if args.server_arg else ''}, greedy `/generate_stream`, "
              f"{args.new_tokens} new tokens, {args.rounds} rounds summed."), ""]
    return "\n".join(lines + table(names, levels, totals)) + "\n"


def engine_step_comparison(args, prompts: list[str], server_settings, machine_line, own_thread) -> str:
    """`--engine-steps`: per architecture and level, the median decode step of its engine beside
    Llama's (bench/steps.py), both in this process, alternating which goes first per round.
    Called on a thread that runs torch serially (the engines' loop, as the server's); each model is
    loaded by `own_thread` (a thread of its own with the benchmark's torch threads), so that no
    second team of torch threads competes with an engine's. Returns the markdown table (tokens/s a
    step allows, summed over rounds as medians' means)."""
    from opentgi.bench import steps as bench_steps
    from opentgi.models.loader import load_model

    names = [n.strip() for n in args.architectures.split(",") if n.strip() and n.strip() != "llama"]
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        raise SystemExit(f"--architectures: unknown {unknown}; known: {', '.join(ARCHITECTURES)}")
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]

    def engine(name: str):
        settings_args = argparse.Namespace(**vars(args))
        settings_args.model_id = str(same_shape_model(name, None))
        settings = server_settings(settings_args)
        loaded = own_thread(lambda: load_model(settings))
        ids = [loaded.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return loaded, settings, ids

    llama = engine("llama")
    steps: dict[tuple[str, str, int], list[float]] = {}  # (architecture, engine measured, c) -> step ms
    for name in names:
        pair = [("llama", llama), (name, engine(name))]
        for round_ in range(args.rounds):
            for c in levels:
                for server, (loaded, settings, ids) in pair if round_ % 2 == 0 else pair[::-1]:
                    ms = bench_steps.measure(loaded, settings, ids, c, args.new_tokens).step_ms
                    steps.setdefault((name, server, c), []).append(ms)
                    print(f"{name} round {round_ + 1}, {server} engine, concurrency {c}: step {ms:.2f} ms",
                          flush=True)
        del pair
    # as `table` wants: tokens and seconds (c tokens a step; the mean of the rounds' median steps)
    totals = {key: [c * len(v), sum(v) / 1e3, 0] for key, v in steps.items() for c in [key[2]]}
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — architectures at SmolLM2-135M's shape, "
             "engine steps", "", f"Machine: {machine_line(args.num_threads)}.",
             (f"Random weights (bfloat16 checkpoints), each architecture's engine beside Llama's in one process, "
              f"default flags{' + ' + ' '.join(args.server_arg) if args.server_arg else ''}, {args.new_tokens} new "
              f"tokens, {args.rounds} rounds: tokens/s that the median decode step allows "
              f"(`--engine-steps`)."), ""]
    return "\n".join(lines + table(names, levels, totals)) + "\n"


def table(names: list[str], levels: list[int], totals: dict[tuple[str, str, int], list]) -> list[str]:
    """The markdown table: per architecture and level its tokens/s, Llama's measured beside it
    (totals: (architecture, server, c) -> [tokens, seconds, errors]) and the ratio."""
    def tps(name: str, server: str, c: int) -> float:
        tokens, wall, _ = totals[(name, server, c)]
        return tokens / wall if wall else 0.0

    lines = ["| architecture | " + " | ".join(f"c={c} tokens/s | Llama beside it | ratio" for c in levels) + " |",
             "|---|" + "---:|---:|---:|" * len(levels)]
    for name in names:
        cells = []
        for c in levels:
            own, base = tps(name, name, c), tps(name, "llama", c)
            errors = totals[(name, name, c)][2] + totals[(name, "llama", c)][2]
            cells.append(f"{own:.1f}{f' ({errors} errors)' if errors else ''} | {base:.1f} | "
                         f"{own / base if base else 0:.2f}x")
        lines.append(f"| {ARCHITECTURES[name][1]} | " + " | ".join(cells) + " |")
    return lines
