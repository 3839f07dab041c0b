"""`LoraLinear`: a projection (one or several fused parts, e.g. q/k/v) plus, for the rows that
use an adapter, that adapter's scaled B(A(x)).

With a batch-invariant model (the default, docs/determinism.md) it holds one `AdapterLora` per
adapter (models/layers/adapter_lora.py, shared with the experts' LoRA): the adapter's A of every
fused part as one shrink matrix and its scaled B as one block-diagonal expand matrix, at its own
rank, in float32. A step computes, for each adapter its rows use, on those rows only,

    y[rows] = y[rows] + (x[rows] @ shrink) @ expand       (float32 `torch.mm`, rounded once into y)

Each matmul multiplies at least the row count probed at start-up to give every row the same bits,
so a row's result depends on its own input and adapter only; a base row is never touched. A step
pays for the adapters its rows use, not for every one loaded.

With `--nondeterministic` the adapters are stacked: per projection one shrink matrix
[in, parts*slots*R] and one expand matrix [slots*R, out] per fused part (ranks zero-padded to the
largest), in the model's dtype, over every token of the step:

    y = base(x) + ((x @ shrink) * mask) @ expand        (per part, into that part's columns)

where `mask` keeps, for each token, only its adapter's columns; a row's delta can then depend on
the step's other rows (tests/engine/test_determinism_lora.py). Both are punica's BGMV done as dense
matmuls; `bgmv_delta`, the per-token gather, is the reference the tests compare against.
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.layers.adapter_lora import AdapterLora
from opentgi.models.lora.step import LoraState, LoraStep


def bgmv_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Punica's BGMV in plain torch: every token gathers its adapter's A [R, in] and B [R, out]
    (a [S, R, in], b [S, R, out]; slot -1 = no adapter). The per-row reference of `LoraLinear`."""
    used = token_slots >= 0
    out = x.new_zeros(x.shape[0], b.shape[-1])
    if used.any():
        rows = used.nonzero().squeeze(1)
        slots = token_slots[rows]
        shrunk = torch.bmm(x[rows].unsqueeze(1), a[slots].transpose(1, 2))  # [n, 1, R]
        out[rows] = torch.bmm(shrunk, b[slots]).squeeze(1)
    return out


class LoraLinear(ForwardWithoutHooks, nn.Module):
    """base(x) plus, for the tokens of rows using an adapter, that adapter's scaled B(A(x)).

    a: [slots, parts, R, in]; b: per part [slots, R, out_p] (already scaled; zero rows pad smaller
    ranks, zero matrices stand for parts an adapter does not adapt).

    `row_invariant` (the default with a batch-invariant model): one `AdapterLora` per adapter, at its
    own rank (`ranks`), added into its own rows only (module docstring). Otherwise
    (--nondeterministic) the stacked form: shrink [in, parts*slots*R] (columns (part, slot, r),
    stored transposed, the faster layout on CPU) and one expand [slots*R, out_p] per part in the
    model's dtype, over every token of the step, masked."""

    def __init__(self, base: nn.Module, state: LoraState, a: torch.Tensor, b: list[torch.Tensor],
                 row_invariant: bool = False, ranks: list[int] | None = None):
        super().__init__()
        self.base = base
        self.state = state
        self.num_slots, self.parts, self.rank, fan_in = a.shape
        self.out_sizes = [part.shape[-1] for part in b]
        self.adapters: list[AdapterLora | None] | None = None
        if row_invariant:
            ranks = ranks or [self.rank] * self.num_slots
            self.adapters = [AdapterLora(a[s, :, :r], [part[s, :r] for part in b]) if a[s].any() else None
                             for s, r in enumerate(ranks)]
            self.per_adapter = nn.ModuleList([m for m in self.adapters if m is not None])  # for .modules()
            for module in self.per_adapter:
                module.make_row_invariant()
            return
        a, b = a.to(state.dtype), [part.to(state.dtype) for part in b]
        self.shrink = a.permute(3, 1, 0, 2).reshape(fan_in, -1).contiguous()
        self.expand = [part.reshape(-1, part.shape[-1]).contiguous() for part in b]
        self._subset_cache: tuple | None = None  # (used slots, shrink, expand) of the last subset

    def _subset(self, step: LoraStep) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stacked matrices of the step's adapters only; kept while consecutive steps use the
        same ones (decode steps mostly do)."""
        cached = self._subset_cache
        if cached is not None and cached[0] == step.used_key:
            return cached[1], cached[2]
        shrink = self.shrink.view(-1, self.parts, self.num_slots, self.rank).index_select(2, step.used)
        shrink = shrink.reshape(shrink.shape[0], -1)
        expand = [e.view(self.num_slots, self.rank, -1).index_select(0, step.used).flatten(0, 1)
                  for e in self.expand]
        self._subset_cache = (step.used_key, shrink, expand)
        return shrink, expand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.state.step
        if step is None:
            return y
        if self.adapters is not None:
            return self._add_per_adapter(x, y, step)
        shrink, expand = self.shrink, self.expand
        if not step.all_slots:  # only the adapters this step uses
            shrink, expand = self._subset(step)
        h = torch.mm(x, shrink).mul_(step.mask(self.parts))
        if self.parts == 1:
            return y.addmm_(h, expand[0])
        width = step.num_used * self.rank
        col = 0
        for p, size in enumerate(self.out_sizes):
            y[:, col:col + size].addmm_(h[:, p * width:(p + 1) * width], expand[p])
            col += size
        return y

    def _add_per_adapter(self, x: torch.Tensor, y: torch.Tensor, step: LoraStep) -> torch.Tensor:
        """y's rows of each adapter the step uses plus that adapter's float32 delta (rounded once,
        into y's dtype)."""
        for slot in step.used_key:
            lora = self.adapters[slot]
            if lora is None:
                continue
            rows = step.rows_of(slot)
            if rows is None:  # every token of the step is this adapter's
                y.add_(lora(x))
            else:
                own = y.index_select(0, rows).float().add_(lora(x.index_select(0, rows)))
                y.index_copy_(0, rows, own.to(y.dtype))
        return y
