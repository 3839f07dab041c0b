"""LoRA adapters on a routed-experts block (models/layers/moe.py): every adapter's matrices on each
expert's gate/up and down projections and on the router, served many adapters a batch.

Each adapter's LoRA on one projection is an `AdapterLora`: a shrink matmul holding its A (gate's
and up's side by side) and an expand matmul holding its scaled B (for gate/up: block-diagonal,
gate's outputs from gate's columns, up's from up's), at the adapter's own rank. In the block's
grouped pass an expert runs, on its contiguous slice of rows, the adapters its rows use (read with
the expert counts, in the same host sync), each as `expand(shrink(x) * mask)` with `mask` keeping
that adapter's rows: `LoraLinear`'s dense-matmul-and-mask form (models/lora.py), per adapter rather
than stacked, so a step pays for the adapters its rows use, not for every adapter loaded. The
router adds each used adapter's delta over every token, masked the same way.

The LoRA matmuls run in float32 (`torch.mm`; the delta is added into the model-dtype output):
oneDNN's packed linears cost ~20-35 us a call whatever their size at these shapes. Side by side in
one process (a 16-row decode step of a 576x30 Qwen3-MoE of 8 experts, bfloat16, 1 thread, one
rank-16 adapter everywhere, machine under load), the experts' LoRA added 0.41x the time of a step
without adapter rows this way against 0.63x through oneDNN's bfloat16 linears (the dense
projections' LoRA 0.03x). Its float32 weights are ~13% of an expert's bfloat16 bytes at that
shape, ~7% at Qwen3-30B-A3B's (hidden 2048), per rank-16 adapter an expert runs.

Row invariance (docs/determinism.md): a row's delta comes from its own adapter's matrices only,
whatever other adapters the step or the expert's slice holds (theirs add exact zeros to it, masked
out). Each matmul multiplies at least the row count measured at start-up to give every row the
same bits (`invariant_min_rows`: torch's float32 mm on the machine this was built on took another
kernel below 4 rows, 8 for some shapes with 2 threads); an expert's shorter slice is multiplied with its neighbours in the grouped
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The float32 delta of each row of x [n, in]; mask [n, 1]: 1 for the rows of this adapter."""
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
    """The LoRA of one routed-experts block, per adapter slot: the router's (`router[s]`) and each
    expert's gate/up (2 parts) and down (`gate_up[e][s]`, `down[e][s]`), None where the adapter
    leaves it. `state` is the model's LoraState: `state.step` is None in a step without adapter
    rows."""

    def __init__(self, state, router: list[AdapterLora | None], gate_up: list[list[AdapterLora | None]],
                 down: list[list[AdapterLora | None]]):
        super().__init__()
        self.state = state
        self.num_slots = len(router)
        self.router = router
        self.gate_up = gate_up
        self.down = down
        every = [*router, *(m for per_expert in (*gate_up, *down) for m in per_expert)]
        self.adapters = nn.ModuleList([m for m in every if m is not None])  # registered once, for .modules()

    def active(self) -> bool:
        """Whether the current step has adapter rows."""
        return self.state.step is not None

    def add_router(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The router's logits plus each token's adapter's delta (each slot the step uses, over every
        token, masked to that slot's tokens)."""
        step = self.state.step
        for s in step.used_key:
            if self.router[s] is not None:
                logits = logits.add_(self.router[s](x, step.token_mask(s)))
        return logits

    def expert_slots(self, experts: torch.Tensor, counts: torch.Tensor) -> tuple[list[int], list[tuple[int, ...]]]:
        """experts [T, k], counts [num_experts] -> (the counts, per expert the slots of its rows'
        adapters), read in one host sync."""
        step, n = self.state.step, counts.shape[0]
        pairs = (experts * self.num_slots + step.token_slots.unsqueeze(1))[step.adapter_tokens()].flatten()
        both = torch.cat([counts, torch.bincount(pairs, minlength=n * self.num_slots)]).tolist()
        slots = [tuple(s for s in range(self.num_slots) if both[n + e * self.num_slots + s]) for e in range(n)]
        return both[:n], slots

    def row_masks(self, token_of: torch.Tensor) -> dict[int, torch.Tensor]:
        """Per slot the step uses, [R, 1] float32: 1 for the rows (token_of: each row's token) of that slot."""
        step = self.state.step
        return {s: step.token_mask(s).index_select(0, token_of) for s in step.used_key}

    def add_gate_up(self, expert: int, slot: int, rows: torch.Tensor, mask: torch.Tensor, start: int,
                    count: int, y: torch.Tensor) -> None:
        """y += the gate/up delta of adapter `slot` on `expert` for rows[start:start + count] (the
        expert's slice of the grouped pass, float32); mask: every row's mask for that slot."""
        lora = self.gate_up[expert][slot]
        if lora is not None:
            y.add_(lora.delta_of_slice(rows, mask, start, count))

    def add_down(self, expert: int, slot: int, rows: torch.Tensor, mask: torch.Tensor, start: int,
                 count: int, y: torch.Tensor) -> None:
        lora = self.down[expert][slot]
        if lora is not None:
            y.add_(lora.delta_of_slice(rows, mask, start, count))

    def make_row_invariant(self) -> None:
        """Every matmul in its row-invariant form (with a batch-invariant model)."""
        for module in self.adapters:
            module.make_row_invariant()
