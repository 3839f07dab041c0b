"""A sparse mixture-of-experts block (Mixtral, Qwen3-MoE) in one grouped pass.

Routing as the checkpoints' own code does it: softmax of the router logits in float32, the top k
experts per token, their weights renormalised to sum to one (Mixtral always; Qwen3-MoE when
`norm_topk_prob`), cast back to the model dtype. The step's (token, expert) pairs are then sorted
by expert (one stable argsort), the expert counts read once, and every expert the step uses runs
one `GatedMLP` over all of its tokens (a contiguous slice of the sorted rows); the weighted outputs
are scatter-added back to their tokens (`index_add_`). The Python loop is over the experts a step
uses, never over tokens. A lone token (a single-stream decode step) skips the sort and the scatter:
its k experts' weighted outputs are summed as `index_add_` sums them (on CPU: in float32, in the
order of the sorted rows, that is by expert, rounded to the model dtype once).

A token's result does not depend on the step's other tokens (docs/determinism.md) when each
expert's linears compute a row alike for every row count (their row-invariant forms,
models/layers/linear.py): routing is per token, and `index_add_` sums a token's k contributions
alone, in expert order, whoever else the experts saw.

With tensor parallelism each rank holds a slice of every expert's intermediate features (the
router is replicated, so every rank routes alike) and `tp` all-reduces the block's output once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.layers.mlp import GatedMLP


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 act: str, names: tuple[str, str, str]):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([GatedMLP(hidden, intermediate, act, names=names)
                                      for _ in range(num_experts)])
        self.tp = None  # models.parallel.TPGroup when sharded: the output is all-reduced

    def fuse_projections(self) -> None:
        for expert in self.experts:
            expert.fuse_projections()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, experts [T, k] int64)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        weights, experts = self.route(x)
        if x.shape[0] == 1:
            return self._one_token(x, weights[0], experts[0])
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        token_of = order // self.top_k
        rows = x.index_select(0, token_of)
        outs = []
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outs.append(self.experts[expert](rows[start:start + count]))
                start += count
        out_rows = torch.cat(outs) if len(outs) > 1 else outs[0]
        out_rows.mul_(weights.flatten().index_select(0, order).unsqueeze(1))
        out = torch.zeros_like(x).index_add_(0, token_of, out_rows)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        ids = experts.tolist()  # the one host sync
        total = None
        for j in sorted(range(len(ids)), key=ids.__getitem__):  # expert order, as the sorted rows
            y = self.experts[ids[j]](x).mul_(weights[j]).float()  # weighted in x's dtype, as there
            total = y if total is None else total.add_(y)
        out = total.to(x.dtype)
        return out if self.tp is None else self.tp.all_reduce(out)
