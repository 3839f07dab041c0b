"""The linear kernels side by side, in one run: bfloat16 through `F.linear` and through oneDNN's
packed weights (models/layers/linear.py), int8 per channel (`_weight_int8pack_mm`) and int4 groups
of 32 (`_weight_int4pack_mm_for_cpu`), at 1, 4, 16, 64 rows and a prompt-sized step (256), on
2048x2048 and 8192x2048 weights (a 1B model's attention and MLP shapes).

`python -m opentgi.bench kernels [--threads N] [--repeats R]` prints a markdown table of median
microseconds per call and each quantized kernel's time over oneDNN bfloat16's. The kernels are
timed in turn, round after round, so that load on the machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

ROWS = (1, 4, 16, 64, 256)
SHAPES = ((2048, 2048), (8192, 2048))  # (out, in)


def _kernels(out_features: int, in_features: int):
    from opentgi.models.layers.linear import OneDNNLinear
    from opentgi.models.quantization import rtn

    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
    dense = weight.to(torch.bfloat16)
    onednn = OneDNNLinear(dense)
    int8 = rtn.int8_rows(weight).to_format(torch.bfloat16, torch.device("cpu"))
    int4 = rtn.int4_groups(weight, 32).to_format(torch.bfloat16, torch.device("cpu"))
    return {"bf16 F.linear": lambda x: F.linear(x, dense), "bf16 oneDNN": onednn,
            "int8": int8.matmul, "int4 g32": int4.matmul}


def measure(repeats: int) -> list[tuple[str, int, dict[str, float]]]:
    results = []
    with torch.inference_mode():
        for out_features, in_features in SHAPES:
            kernels = _kernels(out_features, in_features)
            for rows in ROWS:
                x = torch.randn(rows, in_features).to(torch.bfloat16)
                times: dict[str, list[float]] = {name: [] for name in kernels}
                for fn in kernels.values():
                    fn(x)
                for _ in range(repeats):
                    for name, fn in kernels.items():
                        start = time.perf_counter()
                        fn(x)
                        times[name].append(time.perf_counter() - start)
                results.append((f"{out_features}x{in_features}", rows,
                                {name: statistics.median(t) * 1e6 for name, t in times.items()}))
    return results


def table(results) -> str:
    names = list(results[0][2])
    lines = ["| weight | rows | " + " | ".join(f"{n} (us)" for n in names) + " | int8 / oneDNN | int4 / oneDNN |",
             "|---|---:|" + "---:|" * (len(names) + 2)]
    for shape, rows, us in results:
        lines.append(f"| {shape} | {rows} | " + " | ".join(f"{us[n]:,.0f}" for n in names)
                     + f" | {us['int8'] / us['bf16 oneDNN']:.2f} | {us['int4 g32'] / us['bf16 oneDNN']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m opentgi.bench kernels")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(table(measure(args.repeats)))


if __name__ == "__main__":
    main()
