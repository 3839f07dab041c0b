"""Every weight format's linear kernel side by side, in the dtype this host serves (bfloat16 on CPUs
with native bfloat16, float32 elsewhere: models/loader.py), so that the next cliff shows: dense
(oneDNN's packed weights), int8 per channel, int4 groups of 32 (torch's kernel, in
`int4.kernel_dtype`), and the native kernels on GGUF blocks of each type (opentgi.kernels) where
they build (Q4_1, Q4_K and Q6_K also with `passes=2`, the ~16-bit activations q/k/v and down
projections take; each also repacked by 16 rows where a model served here holds it so:
models/quantization/gguf_blocks.py), at 1, 4, 16 and 64 rows, on 2048x2048 and 8192x2048 weights (a 1B model's attention
and MLP shapes).

`python -m opentgi.bench kernels [--threads N] [--repeats R] [--dtype float32|bfloat16] [--isas
avx2,avx512]` prints a markdown table of median microseconds per call, and the GB/s of weight bytes each format reads
at one row. The kernels are timed in turn, round after round, so that load on the machine falls
on all of them alike.

`python -m opentgi.bench kernels --attention [--context L] [--kv-cache-dtype D]`: decode attention per layer instead,
the torch backend beside the native one (models/attention/), at the default model's attention
shape (9 query heads, 3 kv heads, head_dim 64, blocks of 16): a decode step of 1, 16 and 64 rows
of contexts L/2..L, block tables scattered over the pool, both batch-invariant as served; median
CPU microseconds of this process (the machines are shared) per layer call (the step's plan built
once and reused, as a step's layers reuse it) and per plan (once a step), backends in turn; the
cache in D (default: the dtype computed in, as `--kv-cache-dtype` float32/bfloat16 serves it).

`python -m opentgi.bench kernels --moe [--experts E]`: one mixture-of-experts block at
Qwen3-30B-A3B's layer shape (hidden 2048, experts' intermediate 768, top 8 of 128 experts; gate/up
in Q4_K, down in Q6_K, as a Q4_K_M file holds them; down's activations in two passes, as served),
the router included: the per-expert loop (two native calls per expert a step uses) beside the
grouped experts (one call per projection), at 1, 4 and 16 rows, median microseconds per block
call, in turn.

`python -m opentgi.bench kernels --bandwidth [--megabytes M]`: what one decode row reads, against
what the machine can read: the host's streaming read bandwidth (a float32 sum over M MB, in
torch's threads), then each native block type at one row over a rotation of 8192x2048 weights
holding M MB in all (so they come from memory, not the caches, as a model's layers do), in GB/s of
weight bytes and as a share of the streaming figure (issue target: 80%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from opentgi.models.attention.metadata import AttentionMetadata

ROWS = (1, 4, 16, 64)
SHAPES = ((2048, 2048), (8192, 2048))  # (out, in)


def _gguf_blocks(qtype, out_features: int, in_features: int) -> np.ndarray:
    """Random blocks of `qtype` with modest float16 scales (the kernels' speed does not depend on values)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(out_features, in_features // block, size), dtype=np.uint8)
    offsets = {"Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 82),
               "Q3_K": (108,)}.get(qtype.name, (0,))
    for start in offsets:
        scales = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., start:start + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(out_features, -1)


def kernels(out_features: int, in_features: int, dtype: torch.dtype, native_ok: bool,
            isas: tuple[str | None, ...] = (None,)):
    """name -> (function of x, bytes of weight it reads); the native kernels on each of `isas` (None:
    the best this CPU runs)."""
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as Q

    from opentgi.models.layers.linear import OneDNNLinear, onednn_linear_usable
    from opentgi.models.quantization import rtn

    cpu = torch.device("cpu")
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
    dense = weight.to(dtype)
    found = {}
    if onednn_linear_usable(cpu, dtype):
        found["dense oneDNN"] = (OneDNNLinear(dense), dense.nbytes)
    found["dense F.linear"] = (lambda x: F.linear(x, dense), dense.nbytes)
    int8 = rtn.int8_rows(weight).to_format(dtype, cpu)
    found["int8"] = (int8.matmul, int8.nbytes())
    int4 = rtn.int4_groups(weight, 32).to_format(dtype, cpu)
    found[f"int4 g32 ({str(int4.activation_dtype)[6:]})"] = (int4.matmul, int4.nbytes())
    if native_ok:
        from opentgi.kernels import native

        for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K):
            blocks = torch.from_numpy(_gguf_blocks(qtype, out_features, in_features))
            for isa in isas:
                on = f" {isa}" if isa else ""
                found[f"native {qtype.name}{on}"] = (
                    lambda x, b=blocks, q=int(qtype), i=isa: native.gguf_mm(x, b, q, out_features, i), blocks.nbytes)
                if qtype in (Q.Q4_1, Q.Q4_K, Q.Q6_K):  # ~16-bit activations, as q/k/v and down projections take them
                    found[f"native {qtype.name} 2-pass{on}"] = (
                        lambda x, b=blocks, q=int(qtype), i=isa: native.gguf_mm(x, b, q, out_features, i, passes=2),
                        blocks.nbytes)
                for passes in _by_16_rows(qtype, dtype):  # as served there
                    r16 = native.repack_by_16_rows(blocks, qtype, in_features)
                    found[f"native {qtype.name}{' 2-pass' if passes == 2 else ''} by 16 rows{on}"] = (
                        lambda x, b=r16, q=native.BY_16_ROWS[int(qtype)], i=isa, p=passes:
                            native.gguf_mm(x, b, q, out_features, i, passes=p), r16.nbytes)
    return found


def measure(repeats: int, dtype: torch.dtype, native_ok: bool, isas: tuple[str | None, ...] = (None,)):
    results = []
    with torch.inference_mode():
        for out_features, in_features in SHAPES:
            found = kernels(out_features, in_features, dtype, native_ok, isas)
            for rows in ROWS:
                x = torch.randn(rows, in_features).to(dtype)
                times: dict[str, list[float]] = {name: [] for name in found}
                for fn, _ in found.values():
                    fn(x)
                for _ in range(repeats):
                    for name, (fn, _) in found.items():
                        start = time.perf_counter()
                        fn(x)
                        times[name].append(time.perf_counter() - start)
                us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
                results.append((f"{out_features}x{in_features}", rows, us, {n: b for n, (_, b) in found.items()}))
    return results


def table(results) -> str:
    names = list(results[0][2])
    lines = ["| weight | rows | " + " | ".join(f"{n} (us)" for n in names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for shape, rows, us, nbytes in results:
        lines.append(f"| {shape} | {rows} | " + " | ".join(f"{us[n]:,.0f}" for n in names) + " |")
        if rows == 1:
            lines.append(f"| {shape} | GB/s at 1 row | "
                         + " | ".join(f"{nbytes[n] / us[n] / 1e3:.1f}" for n in names) + " |")
    return "\n".join(lines)


HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
ATTENTION_ROWS = (1, 16, 64)


def decode_step(rows: int, context: int, dtype: torch.dtype, seed: int = 0, kv_dtype: torch.dtype | None = None):
    """(q, k, v, k_cache, v_cache, meta builder): rows decode rows, contexts spread over
    context/2..context, their blocks scattered over the pool (the cache in kv_dtype, else dtype)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(context // 2, context + 1, (rows,), generator=gen).tolist()
    need = [-(-n // BLOCK) for n in lens]
    pool = sum(need) + 8
    order = torch.randperm(pool, generator=gen).tolist()
    tables = torch.full((rows, max(need)), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    k_cache = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=gen).to(kv_dtype or dtype)
    v_cache = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=gen).to(kv_dtype or dtype)
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(rows, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(rows, KV_HEADS, DIM, generator=gen).to(dtype)
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)])
    ctx = torch.tensor(lens, dtype=torch.int32)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
            cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0).to(torch.int32)]),
            max_seqlen_q=1, max_seqlen_k=max(lens), context_lens=ctx, block_tables=tables, decode_only=True,
            prompt_new_tokens=[0] * rows)

    return q, k, v, k_cache, v_cache, meta


def measure_attention(repeats: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
    from opentgi.models.attention.native_backend import NativeAttentionBackend
    from opentgi.models.attention.torch_backend import TorchAttentionBackend
    from opentgi.models.attention.torch_plan import make_plan

    backends = {"torch": TorchAttentionBackend(), "native": NativeAttentionBackend()}
    for backend in backends.values():
        backend.batch_invariant = True
    results = []
    with torch.inference_mode():
        for rows in ATTENTION_ROWS:
            q, k, v, k_cache, v_cache, meta = decode_step(rows, context, dtype, kv_dtype=kv_dtype)
            metas = {name: meta() for name in backends}
            layer: dict[str, list[float]] = {name: [] for name in backends}
            plan: dict[str, list[float]] = {name: [] for name in backends}
            for name, backend in backends.items():
                backend.forward(q, k, v, k_cache, v_cache, metas[name], DIM ** -0.5)
            for _ in range(repeats):
                for name, backend in backends.items():
                    fresh = meta()
                    start = time.process_time()
                    make_plan(fresh, BLOCK, None, dtype, HEADS // KV_HEADS, True, False, native=name == "native")
                    plan[name].append(time.process_time() - start)
                    start = time.process_time()
                    backend.forward(q, k, v, k_cache, v_cache, metas[name], DIM ** -0.5)
                    layer[name].append(time.process_time() - start)
            results.append((rows, {n: statistics.median(t) * 1e6 for n, t in layer.items()},
                            {n: statistics.median(t) * 1e6 for n, t in plan.items()}))
    return results


def attention_table(results) -> str:
    lines = ["| rows | torch (us/layer) | native (us/layer) | torch/native | torch plan (us/step) | "
             "native plan (us/step) |", "|---:|---:|---:|---:|---:|---:|"]
    for rows, layer, plan in results:
        lines.append(f"| {rows} | {layer['torch']:,.0f} | {layer['native']:,.0f} | "
                     f"{layer['torch'] / layer['native']:.1f}x | {plan['torch']:,.0f} | {plan['native']:,.0f} |")
    return "\n".join(lines)


MOE_HIDDEN, MOE_INTERMEDIATE, MOE_TOP_K = 2048, 768, 8
MOE_ROWS = (1, 4, 16)


def moe_block(experts: int, dtype: torch.dtype):
    """A SparseMoE whose experts are random GGML blocks (models/layers/moe.py), fused and grouped."""
    from gguf import GGMLQuantizationType as Q
    from torch import nn

    from opentgi.models.layers.moe import SparseMoE
    from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight, activation_passes
    from opentgi.models.quantization.linear import QuantizedLinear

    with torch.device("meta"):  # no dense expert weights are ever allocated
        block = SparseMoE(MOE_HIDDEN, MOE_INTERMEDIATE, experts, MOE_TOP_K, True, "silu",
                          ("gate_up_proj", None, "down_proj"))
    block.gate = nn.Linear(MOE_HIDDEN, experts, bias=False)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(experts, MOE_HIDDEN, generator=torch.Generator().manual_seed(1)))
    stacks = {}
    for name, qtype, out_features, in_features in (("gate_up_proj", Q.Q4_K, 2 * MOE_INTERMEDIATE, MOE_HIDDEN),
                                                   ("down_proj", Q.Q6_K, MOE_HIDDEN, MOE_INTERMEDIATE)):
        raw = torch.from_numpy(_gguf_blocks(qtype, experts * out_features, in_features))
        stacks[name] = (raw.view(experts, out_features, -1), qtype, in_features)
    for e, expert in enumerate(block.experts):
        for name, (raw, qtype, in_features) in stacks.items():
            linear = QuantizedLinear(in_features, raw.shape[1])
            linear.weight_format = GGUFBlockWeight(raw[e], int(qtype), in_features,
                                                   activation_passes(f"mlp.experts.{e}.{name}.weight"))
            setattr(expert, name, linear)
    block.fuse_projections()
    return block.to(dtype)


def measure_moe(repeats: int, experts: int, dtype: torch.dtype):
    block = moe_block(experts, dtype)
    grouped = block.grouped
    results = []
    with torch.inference_mode():
        for rows in MOE_ROWS:
            x = torch.randn(rows, MOE_HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
            times: dict[str, list[float]] = {"per-expert loop": [], "grouped": []}
            for _ in range(repeats + 1):
                for name, form in (("per-expert loop", None), ("grouped", grouped)):
                    block.grouped = form
                    start = time.perf_counter()
                    block(x)
                    times[name].append(time.perf_counter() - start)
            used = len(set(block.route(x)[1].flatten().tolist()))
            results.append((rows, used, {n: statistics.median(t[1:]) * 1e6 for n, t in times.items()}))
    return results


def moe_table(results) -> str:
    lines = ["| rows | experts used | per-expert loop (us) | grouped (us) | loop/grouped |", "|---:|---:|---:|---:|---:|"]
    for rows, used, us in results:
        lines.append(f"| {rows} | {used} | {us['per-expert loop']:,.0f} | {us['grouped']:,.0f} | "
                     f"{us['per-expert loop'] / us['grouped']:.2f}x |")
    return "\n".join(lines)


BANDWIDTH_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def _by_16_rows(qtype, dtype: torch.dtype) -> tuple[int, ...]:
    """The activation passes at which a model served here holds `qtype` repacked by 16 rows
    (models/quantization/gguf_blocks.py passes_by_16_rows)."""
    from opentgi.models.quantization.gguf_blocks import passes_by_16_rows

    return passes_by_16_rows(dtype).get(int(qtype), ())


def measure_bandwidth(megabytes: int, repeats: int, dtype: torch.dtype = torch.float32):
    """(streaming GB/s, [(kernel, GB/s)]): each block type at one row (in `dtype`, as served) over
    weights of `megabytes` in all, met in turn as a model's layers are; the best of `repeats`
    sweeps. Each type also repacked by 16 rows where a model served here holds it so."""
    from gguf import GGMLQuantizationType as Q

    from opentgi.kernels import native

    total = megabytes * 2**20
    flat = torch.ones(total // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        flat.sum()
        best = min(best, time.perf_counter() - start)
    stream = total / best / 1e9
    del flat
    out_features, in_features = SHAPES[1]
    x = torch.randn(1, in_features).to(dtype)
    results = []
    for name in BANDWIDTH_TYPES:
        qtype = int(Q[name])
        first = torch.from_numpy(_gguf_blocks(Q[name], out_features, in_features))
        weights = [first] + [first.clone() for _ in range(max(1, total // first.nbytes) - 1)]
        forms = [(qtype, 1, weights, "")]
        if name in ("Q4_0", "Q4_1", "Q4_K", "Q6_K"):
            forms.append((qtype, 2, weights, " 2-pass"))
        for passes in _by_16_rows(Q[name], dtype):
            forms.append((native.BY_16_ROWS[qtype], passes, [native.repack_by_16_rows(w, qtype, in_features)
                                                           for w in weights],
                          f"{' 2-pass' if passes == 2 else ''} by 16 rows"))
        for form, passes, held, suffix in forms:
            native.gguf_mm(x, held[0], form, out_features, passes=passes)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for w in held:
                    native.gguf_mm(x, w, form, out_features, passes=passes)
                best = min(best, time.perf_counter() - start)
            results.append((f"native {name}{suffix}", len(held) * first.nbytes / best / 1e9))
        del weights, forms
    return stream, results


def bandwidth_table(stream: float, results) -> str:
    lines = ["| kernel, one row | GB/s | share of streaming reads |", "|---|---:|---:|",
             f"| streaming read (float32 sum) | {stream:.1f} | 100% |"]
    lines += [f"| {name} | {gbs:.1f} | {100 * gbs / stream:.0f}% |" for name, gbs in results]
    return "\n".join(lines)


def main(argv=None) -> None:
    from opentgi.kernels import native
    from opentgi.models.loader import cpu_has_bf16

    parser = argparse.ArgumentParser(prog="python -m opentgi.bench kernels")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: what this host serves (bfloat16 with native bfloat16, else float32)")
    parser.add_argument("--attention", action="store_true", help="decode attention per layer instead")
    parser.add_argument("--context", type=int, default=512, help="--attention: the longest context")
    parser.add_argument("--kv-cache-dtype", choices=("float16", "bfloat16", "float32"), default=None,
                        help="--attention: the cache's dtype (default: --dtype's)")
    parser.add_argument("--moe", action="store_true", help="a mixture-of-experts block instead")
    parser.add_argument("--experts", type=int, default=128, help="--moe: how many experts")
    parser.add_argument("--bandwidth", action="store_true",
                        help="one row's weight reads against the host's streaming read bandwidth instead")
    parser.add_argument("--megabytes", type=int, default=512, help="--bandwidth: weights (and the read) in MB")
    parser.add_argument("--isas", default="",
                        help="the native kernels on each of these instruction-set variants, side by side "
                             "(comma-separated, e.g. avx2,avx512; default: the best this CPU runs)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    path = native.load("auto")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}, kernels {path.describe()}, "
          f"median of {args.repeats}")
    if (args.attention or args.moe or args.bandwidth) and path.name != "native":
        raise SystemExit(f"--attention, --moe and --bandwidth need the native kernels: {path.describe()}")
    if args.bandwidth:
        print(f"one row's weight reads over {args.megabytes} MB of weights, best of {args.repeats} sweeps")
        print(bandwidth_table(*measure_bandwidth(args.megabytes, args.repeats, dtype)))
    elif args.moe:
        print(f"MoE block: hidden {MOE_HIDDEN}, intermediate {MOE_INTERMEDIATE}, top {MOE_TOP_K} of {args.experts} "
              "experts, Q4_K gate/up, Q6_K down")
        print(moe_table(measure_moe(args.repeats, args.experts, dtype)))
    elif args.attention:
        kv_dtype = getattr(torch, args.kv_cache_dtype) if args.kv_cache_dtype else dtype
        print(f"decode attention, contexts {args.context // 2}-{args.context}, {kv_dtype} cache, CPU us")
        print(attention_table(measure_attention(args.repeats, args.context, dtype, kv_dtype)))
    else:
        isas = tuple(args.isas.split(",")) if args.isas else (None,)
        if args.isas and path.name == "native":
            missing = [isa for isa in isas if isa not in native.supported_isas()]
            if missing:
                raise SystemExit(f"--isas: {', '.join(missing)} not on this CPU (it runs {', '.join(native.supported_isas())})")
        print(table(measure(args.repeats, dtype, path.name == "native", isas)))


if __name__ == "__main__":
    main()
