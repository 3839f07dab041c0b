"""RMSNorm exactly as Llama computes it (variance in float32, weight applied in the input dtype),
with the intermediate steps in place (the same numbers, fewer allocations)."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        rstd = x32.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        x32 = x32 * rstd if x32 is x else x32.mul_(rstd)  # in place on the upcast copy only, never on x
        return x32.to(dtype).mul_(self.weight)
