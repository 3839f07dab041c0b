"""The decoder's norms, computed exactly as their Hugging Face models compute them.

- `RMSNorm` (Llama, Qwen, Mistral, Phi-3): variance in float32, weight applied in the input dtype,
  with the intermediate steps in place (the same numbers, fewer allocations).
- `GemmaRMSNorm` (Gemma 1/2/3): the weight is stored as an offset from 1 and applied as
  `(1 + w)` in float32 before the cast back.
- `LayerNorm` (StarCoder2): torch's, with its bias.
"""

from __future__ import annotations

import torch
from torch.nn import LayerNorm

__all__ = ["GemmaRMSNorm", "LayerNorm", "RMSNorm", "make_norm"]


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


class GemmaRMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        rstd = x32.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        x32 = x32 * rstd if x32 is x else x32.mul_(rstd)
        return x32.mul_(self.weight.float() + 1.0).to(x.dtype)


def make_norm(kind: str, size: int, eps: float) -> torch.nn.Module:
    """kind: "rms" | "gemma_rms" | "layer" (a FamilyParts.norm)."""
    if kind == "rms":
        return RMSNorm(size, eps)
    if kind == "gemma_rms":
        return GemmaRMSNorm(size, eps)
    if kind == "layer":
        return LayerNorm(size, eps=eps)
    raise ValueError(f"unknown norm {kind!r}")
