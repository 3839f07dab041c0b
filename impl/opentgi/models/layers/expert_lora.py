"""LoRA adapters on a routed-experts block (models/layers/moe.py): every adapter's matrices on each
expert's gate/up and down projections and on the router, served many adapters a batch.

Each adapted projection is a `StackedLora`: one shrink linear holding the A matrices of every
loaded adapter (rows (part, slot, r), ranks zero-padded to the largest) and one expand linear
holding the scaled B matrices (for gate/up: block-diagonal, gate's outputs from gate's columns, up's
from up's). A row's delta is `expand(shrink(x) * mask)`, `mask` keeping the columns of the row's
own adapter: `LoraLinear`'s dense-matmul form (models/lora.py), on the rows an expert takes in the
block's grouped pass (each (token, expert) row masked by its token's adapter).

Row invariance (docs/determinism.md): the columns are those of every loaded adapter, not of the
ones a step uses, so a row's reductions have the same length and its terms the same places
whoever else the step holds; the two linears take the model's row-invariant forms
(models/layers/linear.py), and the masked-out columns add exact zeros. A row's delta, and so its
result, does not depend on the step's other rows, and a base row in a step with adapter rows keeps
the bits it has without them. A step without adapter rows does no LoRA work.
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.models.layers.linear import onednn_linear_usable, pack_linears, tile_linears


class StackedLora(nn.Module):
    """One projection's LoRA for every slot: a [slots, parts, R, in] and b per part [slots, R, out_p]
    (B already scaled; zero where an adapter leaves a part or a rank unused)."""

    def __init__(self, a: torch.Tensor, b: list[torch.Tensor]):
        super().__init__()
        slots, self.parts, rank, fan_in = a.shape
        width = slots * rank
        self.shrink = nn.Linear(fan_in, self.parts * width, bias=False, device=a.device, dtype=a.dtype)
        self.expand = nn.Linear(self.parts * width, sum(p.shape[-1] for p in b), bias=False,
                                device=a.device, dtype=a.dtype)
        with torch.no_grad():
            self.shrink.weight.copy_(a.transpose(0, 1).reshape(-1, fan_in))  # rows (part, slot, r)
            self.expand.weight.zero_()
            row = 0
            for p, part in enumerate(b):
                out = part.shape[-1]
                self.expand.weight[row:row + out, p * width:(p + 1) * width] = part.reshape(width, out).t()
                row += out

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The delta of each row of x [n, in]; mask [n, parts*slots*R] (columns (part, slot, r))."""
        return self.expand(self.shrink(x).mul_(mask))


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

    def add_gate_up(self, expert: int, x: torch.Tensor, y: torch.Tensor, masks2: torch.Tensor) -> None:
        """y += the gate/up delta of `expert` for rows x; masks2: the rows' masks, repeated per part."""
        lora = self.gate_up[expert]
        if lora is not None:
            y.add_(lora(x, masks2))

    def add_down(self, expert: int, x: torch.Tensor, y: torch.Tensor, masks: torch.Tensor) -> None:
        lora = self.down[expert]
        if lora is not None:
            y.add_(lora(x, masks))

    def finish(self, device: torch.device, dtype: torch.dtype, row_invariant: bool) -> None:
        """The linears in the forms the model's own take (PagedDecoder.materialize)."""
        if onednn_linear_usable(device, dtype):
            pack_linears(self, row_invariant=row_invariant)
        elif row_invariant:
            tile_linears(self)
