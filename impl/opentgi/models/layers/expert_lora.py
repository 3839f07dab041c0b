"""LoRA adapters on a routed-experts block (models/layers/moe.py): every adapter's matrices on each
expert's gate/up and down projections and on the router, served many adapters a batch.

Each adapted projection is a `StackedLora`: one shrink matmul holding the A matrices of every
loaded adapter (columns (part, slot, r), ranks zero-padded to the largest) and one expand matmul
holding the scaled B matrices (for gate/up: block-diagonal, gate's outputs from gate's columns, up's
from up's). A row's delta is `expand(shrink(x) * mask)`, `mask` keeping the columns of the row's
own adapter: `LoraLinear`'s dense-matmul form (models/lora.py), on the rows an expert takes in the
block's grouped pass (each (token, expert) row masked by its token's adapter).

The LoRA matmuls run in float32 (`torch.mm`; the delta is added into the model-dtype output):
oneDNN's packed linears cost ~20-35 us a call whatever their size at these shapes. Side by side in
one process (a 16-row decode step of a 576x30 Qwen3-MoE of 8 experts, bfloat16, 1 thread, one
rank-16 adapter everywhere, machine under load), the experts' LoRA added 0.41x the time of a step
without adapter rows this way against 0.63x through oneDNN's bfloat16 linears (the dense
projections' LoRA 0.03x). Its float32 weights are ~13% of an expert's bfloat16 bytes at that
shape, ~7% at Qwen3-30B-A3B's (hidden 2048), per rank-16 adapter loaded.

Row invariance (docs/determinism.md): the columns are those of every loaded adapter, not of the
ones a step uses, so a row's reductions have the same length and its terms the same places
whoever else the step holds, and the masked-out columns add exact zeros. Each matmul multiplies at
least the row count measured at start-up to give every row the same bits (`invariant_min_rows`:
torch's float32 mm on the machine this was built on took another kernel below 4 rows, 8 for some
shapes with 2 threads); an expert's shorter slice is multiplied with its neighbours in the grouped
rows, a lone token's padded with zero rows. A row's delta, and so its result, does not depend on
the step's other rows, and a base row keeps the bits it has in a step without adapter rows. A step
without adapter rows does no LoRA work.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.layers.linear import _formulation_cache

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
    every row count, measured once per shape on random data (kept with the linears' measured forms,
    models/layers/linear.py); the largest candidate, with a warning, if none does."""
    key = ("lora-mm", fan_in, fan_out, "float32")
    if key in _formulation_cache:
        return _formulation_cache[key]
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
    _formulation_cache[key] = found
    return found


class StackedLora(nn.Module):
    """One projection's LoRA for every slot: a [slots, parts, R, in] and b per part [slots, R, out_p]
    (B already scaled; zero where an adapter leaves a part or a rank unused)."""

    def __init__(self, a: torch.Tensor, b: list[torch.Tensor]):
        super().__init__()
        slots, self.parts, rank, fan_in = a.shape
        width = slots * rank
        shrink = a.float().permute(3, 1, 0, 2).reshape(fan_in, -1)  # columns (part, slot, r)
        expand = torch.zeros(self.parts * width, sum(p.shape[-1] for p in b), device=a.device)
        col = 0
        for p, part in enumerate(b):
            out = part.shape[-1]
            expand[p * width:(p + 1) * width, col:col + out] = part.float().reshape(width, out)
            col += out
        self.shrink = RowInvariantMatmul(shrink)
        self.expand = RowInvariantMatmul(expand)

    @property
    def min_rows(self) -> int:
        return max(self.shrink.min_rows, self.expand.min_rows)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The float32 delta of each row of x [n, in]; mask [n, parts*slots*R] (columns (part, slot, r))."""
        return self.expand(self.shrink(x).mul_(mask))

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


class ExpertLora(nn.Module):
    """The LoRA of one routed-experts block: per expert, the gate/up (2 parts) and down
    `StackedLora` (None where no adapter touches that expert), and the router's. `state` is the
    model's LoraState: `state.step` is None in a step without adapter rows."""

    def __init__(self, state, router: StackedLora | None, gate_up: list[StackedLora | None],
                 down: list[StackedLora | None]):
        super().__init__()
        self.state = state
        self.router = router
        self.gate_up_layers = nn.ModuleDict({str(e): m for e, m in enumerate(gate_up) if m is not None})
        self.down_layers = nn.ModuleDict({str(e): m for e, m in enumerate(down) if m is not None})
        # per expert, for the grouped pass's loop (the modules above; their linears are replaced in place)
        self.gate_up = gate_up
        self.down = down

    def step_masks(self) -> torch.Tensor | None:
        """[T, slots*R] of this step (columns (slot, r): 1 for the token's adapter), or None when no
        row uses an adapter."""
        step = self.state.step
        return None if step is None else step.slots_mask()

    def adapter_tokens(self) -> torch.Tensor:
        """[T] bool: the step's tokens whose row uses an adapter (only while `step_masks` is not None)."""
        return self.state.step.adapter_tokens()

    def add_router(self, x: torch.Tensor, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        return logits if self.router is None else logits.add_(self.router(x, masks))

    def add_gate_up(self, expert: int, rows: torch.Tensor, masks2: torch.Tensor, start: int, count: int,
                    y: torch.Tensor) -> None:
        """y += the gate/up delta of `expert` for rows[start:start + count] (the expert's slice of
        the grouped pass); masks2: every row's mask, repeated per part."""
        lora = self.gate_up[expert]
        if lora is not None:
            y.add_(lora.delta_of_slice(rows, masks2, start, count))

    def add_down(self, expert: int, rows: torch.Tensor, masks: torch.Tensor, start: int, count: int,
                 y: torch.Tensor) -> None:
        lora = self.down[expert]
        if lora is not None:
            y.add_(lora.delta_of_slice(rows, masks, start, count))

    def make_row_invariant(self) -> None:
        """Every matmul in its row-invariant form (with a batch-invariant model)."""
        for module in self.modules():
            if isinstance(module, StackedLora):
                module.make_row_invariant()
