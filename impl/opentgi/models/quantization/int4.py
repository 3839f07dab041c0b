"""Weights that already are 4-bit, served from their 4-bit form for steps of a few rows (CPU).

A checkpoint converted from a GGUF Q4_1 file (the default model) holds, in float32, weights that
lie on a 4-bit grid: in every group of 32 inputs of an output row, `w = lo + d * k` with
`k in 0..15` (ggml's Q4_1 puts the group's minimum at k=0 and its maximum at k=15).
`find_int4_grid` recovers `k`, `d` and `lo` exactly where that holds, and nowhere else: no weight
is rounded to a grid it was not on.

A decode step of one stream multiplies one row by every weight, so it is bound by reading them.
torch's `_weight_int4pack_mm_for_cpu` reads a quarter of the bytes of bfloat16. Measured on an
Intel Xeon (AMX) with 2 threads, the 120 layer matmuls of SmolLM2-135M took:
- 3.6 ms with 1 row, against 12.1 ms through oneDNN in bfloat16;
- 6.4 ms with 4 rows, against 12.1 ms;
- 22.6 ms with 16 rows, against 13.0 ms.
On an AMD EPYC the same kernel ran at 0.6 GB/s, far slower than bfloat16. So
`int4_rows_worth_it` measures both at start-up, and the model (`PagedLlama.use_int4_for`) turns
the 4-bit copies on (`Int4Switch`) only for steps of at most that many rows that feed generated
tokens alone. Prompts and larger steps keep the bfloat16 weights.

The kernel computes `(k - 8) * scale + zero` with bfloat16 scales and zeros, so a row's result
differs from the bfloat16 path by rounding, about as much as the bfloat16 path differs from
float32.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # ggml's Q4_0 / Q4_1 block
_LEVELS = 15
_PROBE_ROWS = (1, 2, 4, 8)
_SAMPLE_ROWS = 8  # rows checked before the whole tensor
_MIN_GAIN = 0.8  # the 4-bit copy is used only for row counts where it takes < 80% of the time


@dataclass
class Int4Grid:
    """`weight[n, g*32 + i] == lo[n, g] + d[n, g] * k[n, g*32 + i]` (float32)."""

    k: torch.Tensor  # uint8 [N, K], values 0..15
    d: torch.Tensor  # float32 [N, K / 32]
    lo: torch.Tensor  # float32 [N, K / 32]

    @staticmethod
    def cat(grids: list[Int4Grid]) -> Int4Grid:
        """The grid of the weights stacked along the output dimension (a fused projection)."""
        return Int4Grid(torch.cat([g.k for g in grids]), torch.cat([g.d for g in grids]),
                        torch.cat([g.lo for g in grids]))


def find_int4_grid(weight: torch.Tensor) -> Int4Grid | None:
    """The 4-bit grid `weight` ([out, in]) lies on, or None if any group is off it.

    Off the grid means a weight differs from `lo + d * k` by more than float32 rounding of that
    sum (2**-20 of the group's range): such a tensor keeps only its dense form. Only float32
    checkpoints hold such grids exactly (a GGUF's dequantized weights); the first rows are checked
    first, so a dense checkpoint's tensors cost little at loading."""
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE or weight.dtype != torch.float32:
        return None
    if weight.shape[0] > _SAMPLE_ROWS and _grid_of(weight[:_SAMPLE_ROWS]) is None:
        return None
    return _grid_of(weight)


def _grid_of(weight: torch.Tensor) -> Int4Grid | None:
    n, k_dim = weight.shape
    groups = weight.detach().reshape(n, k_dim // GROUP_SIZE, GROUP_SIZE)
    lo = groups.amin(-1)
    span = groups.amax(-1) - lo
    d = span / _LEVELS
    safe_d = torch.where(d > 0, d, torch.ones_like(d))
    k = ((groups - lo[..., None]) / safe_d[..., None]).round_().clamp_(0, _LEVELS)
    error = (lo[..., None] + d[..., None] * k - groups).abs_().amax(-1)
    if not bool((error <= span * 2.0 ** -20).all()):
        return None
    return Int4Grid(k.to(torch.uint8).view(n, k_dim), d, lo)


def int4_kernel_usable(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16
            and hasattr(torch, "_weight_int4pack_mm_for_cpu")
            and hasattr(torch, "_convert_weight_to_int4pack_for_cpu"))


class Int4Switch:
    """Whether this step multiplies through the 4-bit copies; one per model, shared by its linears,
    set before each forward by `PagedLlama.use_int4_for` (the model runner calls it)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


class Int4Weight:
    """A weight in the layout of torch's CPU int4 kernel, multiplied by bfloat16 rows."""

    def __init__(self, grid: Int4Grid, dtype: torch.dtype = torch.bfloat16):
        self.out_features, self.in_features = grid.k.shape
        self.packed = torch._convert_weight_to_int4pack_for_cpu(grid.k.to(torch.int32), 1)
        # (k - 8) * d + zero == lo + d * k  =>  zero = lo + 8 d; [K / 32, N, 2] as the kernel wants
        self.scales_and_zeros = torch.stack([grid.d.T, (grid.lo + 8 * grid.d).T], dim=-1).to(dtype).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for x of shape [..., in_features]."""
        rows = x.reshape(-1, self.in_features)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return out.view(*x.shape[:-1], self.out_features)


def int4_rows_worth_it(linears: list, repeats: int = 3) -> int:
    """The largest step (rows) for which the 4-bit copies of `linears` (OneDNNLinear with `int4`
    set) take under 80% of the time of their oneDNN bfloat16 weights; 0 where they never do, or
    the kernel fails. All of them are timed in turn, as a step runs them, so the weights come
    from memory, not from cache, as they do when serving."""
    if not linears:
        return 0
    best = 0
    try:
        with torch.inference_mode():
            for rows in _PROBE_ROWS:
                dense_seconds, int4_seconds = _measure(linears, rows, repeats)
                if int4_seconds >= _MIN_GAIN * dense_seconds:
                    break
                best = rows
    except Exception:  # noqa: BLE001 - an old or odd build: the dense weights serve
        log.warning("torch's CPU int4 kernel failed; using the dense weights", exc_info=True)
        return 0
    return best


def _measure(linears: list, rows: int, repeats: int) -> tuple[float, float]:
    """Seconds for one pass over `linears` with `rows` rows: (dense weights, 4-bit copies)."""
    inputs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in {lin.in_features for lin in linears}}

    def dense() -> None:
        for lin in linears:
            lin.dense_forward(inputs[lin.in_features])

    def int4() -> None:
        for lin in linears:
            lin.int4.matmul(inputs[lin.in_features])

    return _best_time(dense, repeats), _best_time(int4, repeats)


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
