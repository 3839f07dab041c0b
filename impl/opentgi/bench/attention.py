"""Decode attention per layer, the torch backend beside the native one (models/attention/), at the
default model's attention shape (9 query heads, 3 kv heads, head_dim 64, blocks of 16), in the
dtype this host serves: a decode step of 1, 16 and 64 rows of mixed context lengths, block tables
scattered over the pool, both backends batch-invariant as served.

`python -m opentgi.bench attention [--threads N] [--repeats R] [--context L]` prints a markdown
table of median CPU microseconds (this process's CPU time: the machines are shared) per layer call
(the step's plan built once and reused, as the layers of one step reuse it) and per plan (once a
step). Backends are timed in turn, round after round, so that load on the machine falls on both
alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opentgi.models.attention.metadata import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
ROWS = (1, 16, 64)


def decode_step(rows: int, context: int, dtype: torch.dtype, seed: int = 0):
    """(q, k, v, k_cache, v_cache, meta builder): rows decode rows, contexts spread over
    context/2..context, their blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(context // 2, context + 1, (rows,), generator=gen).tolist()
    need = [-(-n // BLOCK) for n in lens]
    pool = sum(need) + 8
    order = torch.randperm(pool, generator=gen).tolist()
    tables = torch.full((rows, max(need)), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    k_cache = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
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


def measure(repeats: int, context: int, dtype: torch.dtype):
    from opentgi.models.attention.native_backend import NativeAttentionBackend
    from opentgi.models.attention.torch_backend import TorchAttentionBackend
    from opentgi.models.attention.torch_plan import make_plan

    backends = {"torch": TorchAttentionBackend(), "native": NativeAttentionBackend()}
    for backend in backends.values():
        backend.batch_invariant = True
    results = []
    with torch.inference_mode():
        for rows in ROWS:
            q, k, v, k_cache, v_cache, meta = decode_step(rows, context, dtype)
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


def table(results) -> str:
    lines = ["| rows | torch (us/layer) | native (us/layer) | torch/native | torch plan (us/step) | "
             "native plan (us/step) |", "|---:|---:|---:|---:|---:|---:|"]
    for rows, layer, plan in results:
        lines.append(f"| {rows} | {layer['torch']:,.0f} | {layer['native']:,.0f} | "
                     f"{layer['torch'] / layer['native']:.1f}x | {plan['torch']:,.0f} | {plan['native']:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from opentgi.kernels import native
    from opentgi.models.loader import cpu_has_bf16

    parser = argparse.ArgumentParser(prog="python -m opentgi.bench attention")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=512, help="the longest context (rows span half of it to it)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: what this host serves (bfloat16 with native bfloat16, else float32)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    path = native.load("native")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}, kernels {path.describe()}, "
          f"contexts {args.context // 2}-{args.context}, median of {args.repeats}")
    print(table(measure(args.repeats, args.context, dtype)))


if __name__ == "__main__":
    main()
