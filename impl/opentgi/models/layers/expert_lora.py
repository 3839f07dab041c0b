"""LoRA adapters on a routed-experts block (models/layers/moe.py): every adapter's matrices on each
expert's gate/up and down projections and on the router, served many adapters a batch.

Each adapter's LoRA on one projection is an `AdapterLora` (models/layers/adapter_lora.py, shared
with the dense projections' `LoraLinear`): a shrink matmul holding its A (gate's and up's side by
side) and an expand matmul holding its scaled B (for gate/up: block-diagonal), at the adapter's
own rank, in float32 (`torch.mm`, the delta added into the model-dtype output: cheaper at these
small shapes than oneDNN's packed linears, docs/benchmarks.md). In the block's grouped pass an
expert runs, on its contiguous slice of rows, the adapters its rows use (read with the expert
counts, in the same host sync), each as `expand(shrink(x) * mask)` with `mask` keeping that
adapter's rows, so a step pays for the adapters its rows use, not for every adapter loaded. The
router adds each used adapter's delta over every token, masked the same way.

Row invariance (docs/determinism.md): a row's delta comes from its own adapter's matrices only,
whatever other adapters the step or the expert's slice holds (theirs add exact zeros to it, masked
out). Each matmul multiplies at least the row count probed at start-up to give every row the
same bits (`invariant_min_rows`); an expert's shorter slice is multiplied with its neighbours in
the grouped rows, a lone token's padded with zero rows. A row's delta, and so its result, does not
depend on the step's other rows, and a base row keeps the bits it has in a step without adapter rows. A step
without adapter rows does no LoRA work.
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.models.layers.adapter_lora import AdapterLora


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

    def add_delta(self, projection: str, expert: int, slot: int, rows: torch.Tensor, mask: torch.Tensor,
                  start: int, count: int, y: torch.Tensor) -> None:
        """y += the delta of adapter `slot` on `expert`'s `projection` ("gate_up_proj" or
        "down_proj") for rows[start:start + count] (the expert's slice of the grouped pass,
        float32); mask: every row's mask for that slot."""
        lora = (self.gate_up if projection == "gate_up_proj" else self.down)[expert][slot]
        if lora is not None:
            y.add_(lora.delta_of_slice(rows, mask, start, count))

    def make_row_invariant(self) -> None:
        """Every matmul in its row-invariant form (with a batch-invariant model)."""
        for module in self.adapters:
            module.make_row_invariant()
