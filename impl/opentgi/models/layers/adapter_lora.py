"""One adapter's LoRA on one projection, in float32 matmuls whose rows do not depend on the step's
other rows: shared by the dense projections' LoRA (`LoraLinear`, models/lora/) and the experts'
(models/layers/expert_lora.py).

An `AdapterLora` holds an adapter's A (its fused parts' side by side: q/k/v, gate/up) as one shrink
matrix and its scaled B as one block-diagonal expand matrix (each part's outputs from its own
columns), at the adapter's own rank; the delta of rows x is `expand(shrink(x))`, in float32
(`torch.mm`), added by the caller into the model-dtype output: oneDNN's packed linears have a
fixed cost a call that dominates such small matmuls (docs/benchmarks.md).

Row invariance (docs/determinism.md): torch's float32 mm takes another kernel below a few rows,
how few depending on the CPU, the shape and the thread count. `invariant_min_rows` probes per
matrix shape, once at start-up (kept with the linears' kernel choices,
models/layers/kernel_choices.py), the fewest rows for which every row gets the same bits for every row
count; a matmul of fewer rows is zero-padded to that many (`RowInvariantMatmul`), or its rows are
multiplied together with neighbouring rows (`AdapterLora.delta_of_slice`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.layers.linear import kernel_choices

log = logging.getLogger(__name__)

_MIN_ROWS = (1, 2, 4, 8, 16)  # candidates, smallest first
_PROBE_ROW_COUNTS = (1, 2, 3, 5, 7, 16, 17, 64)


class RowInvariantMatmul(nn.Module):
    """`x @ weight` in float32 (x of any float dtype), fewer rows than `min_rows` padded with zero
    rows (`invariant_min_rows`)."""

    def __init__(self, weight: torch.Tensor, min_rows: int = 1):
        super().__init__()
        self.register_buffer("weight", weight.detach().float().contiguous(), persistent=False)  # [in, out]
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        x = x.float()
        if rows >= self.min_rows:
            return torch.mm(x, self.weight)
        return torch.mm(F.pad(x, (0, 0, 0, self.min_rows - rows)), self.weight)[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[0]}, out_features={self.weight.shape[1]}, min_rows={self.min_rows}"


def invariant_min_rows(fan_in: int, fan_out: int) -> int:
    """The fewest rows a float32 mm of this shape must take for every row to get the same bits for
    every row count, probed once per shape on random data (kept with the linears' kernel choices,
    models/layers/kernel_choices.py); the largest candidate, with a warning, if none does."""
    key = ("lora-mm", fan_in, fan_out, "float32")
    if key in kernel_choices:
        return kernel_choices[key]
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(fan_in, fan_out, generator=gen) * fan_in ** -0.5
    x = torch.randn(128, fan_in, generator=gen)
    found = None
    with torch.inference_mode():
        for min_rows in _MIN_ROWS:
            probe = RowInvariantMatmul(weight, min_rows)
            reference = probe(x)
            if all(torch.equal(probe(x[s:s + count]), reference[s:s + count])
                   for count in _PROBE_ROW_COUNTS for s in range(0, x.shape[0] - count + 1, count)):
                found = min_rows
                break
    if found is None:
        log.warning("no row-invariant form of a %dx%d float32 LoRA matmul found: its rows may differ "
                    "with the step's row count", fan_in, fan_out)
        found = _MIN_ROWS[-1]
    kernel_choices[key] = found
    return found


class AdapterLora(nn.Module):
    """One adapter's LoRA on one projection, its parts fused (gate and up): a [parts, r, in] and b
    per part [r, out_p] (B already scaled). shrink [in, parts*r] (columns (part, r)); expand
    [parts*r, out] block-diagonal (each part's outputs from its own columns)."""

    def __init__(self, a: torch.Tensor, b: list[torch.Tensor]):
        super().__init__()
        parts, rank, fan_in = a.shape
        shrink = a.float().permute(2, 0, 1).reshape(fan_in, parts * rank)
        expand = torch.zeros(parts * rank, sum(p.shape[-1] for p in b), device=a.device)
        col = 0
        for p, part in enumerate(b):
            expand[p * rank:(p + 1) * rank, col:col + part.shape[-1]] = part.float()
            col += part.shape[-1]
        self.shrink = RowInvariantMatmul(shrink)
        self.expand = RowInvariantMatmul(expand)

    @property
    def min_rows(self) -> int:
        return max(self.shrink.min_rows, self.expand.min_rows)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 delta of each row of x [n, in]; mask [n, 1]: 1 for the rows of this adapter
        (None: every row)."""
        shrunk = self.shrink(x)
        return self.expand(shrunk if mask is None else shrunk.mul_(mask))

    def delta_of_slice(self, x: torch.Tensor, mask: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """The delta of rows [start, start + count) of x. Fewer rows than `min_rows` are multiplied
        with their neighbours in x (a view, no copy; a row's bits do not depend on the others')
        rather than padded, unless x itself is shorter."""
        lo = max(0, min(start, x.shape[0] - self.min_rows))
        hi = max(start + count, lo + self.min_rows)
        return self(x[lo:hi], mask[lo:hi])[start - lo:start - lo + count]

    def make_row_invariant(self) -> None:
        for matmul in (self.shrink, self.expand):
            matmul.min_rows = invariant_min_rows(*matmul.weight.shape)
