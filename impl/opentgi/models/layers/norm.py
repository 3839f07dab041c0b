"""The decoder's norms: the functions their Hugging Face models compute (Gemma's by another route).

- `RMSNorm` (Llama, Qwen, Mistral, Phi-3): variance in float32, weight applied in the input dtype,
  with the intermediate steps in place (the same numbers, fewer allocations).
- `GemmaRMSNorm` (Gemma 1/2/3): the weight is stored as an offset from 1 and applied as
  `(1 + w)` in float32 before the cast back. Computed as a LayerNorm over [x, -x] (mean 0, so its
  variance is x's mean square) with (1 + w) as its float32 weight, the first half kept: two ops
  (a `cat` and torch's fused `layer_norm`, which computes a bfloat16 row in float32 and rounds
  once) and a copy of the kept half, where `F.rms_norm` on CPU is a composite of about eight, with
  two dtype conversions around it (faster for a decode row: docs/benchmarks.md).
  Rows are normed independently.
- `LayerNorm` (StarCoder2): torch's, with its bias.

Where the native kernels serve the model (`use_native`: the native attention backend, set by the
model), `RMSNorm`, `GemmaRMSNorm` (its float32 1 + w) and `HeadsNorm` (a weight per head) run as
one native op (`opentgi::rms_norm`), and `add_and_norm` adds the residual and norms the sum in one
pass (`opentgi::add_rms_norm`): the same formula, the sum of squares in the kernel's own fixed
order (other bits than torch's, within float rounding; the same bits for a row whatever the rows
beside it). The torch composition is the fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import LayerNorm

from opentgi.kernels import native
from opentgi.models.base import ForwardWithoutHooks

__all__ = ["GemmaRMSNorm", "HeadsNorm", "LayerNorm", "RMSNorm", "add_and_norm", "make_norm"]


class RMSNorm(ForwardWithoutHooks, torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.native = False  # the native op serves (`use_native`)

    def _native_serves(self, x: torch.Tensor) -> bool:
        return (self.native and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and x.dtype in (torch.float32, torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_serves(x):
            return native.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        rstd = x32.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        x32 = x32 * rstd if x32 is x else x32.mul_(rstd)  # in place on the upcast copy only, never on x
        return x32.to(dtype).mul_(self.weight)


class GemmaRMSNorm(ForwardWithoutHooks, torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        # (weight version, 1 + weight in float32, that twice over)
        self._scale: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self.native = False  # the native op serves (`use_native`)

    def scale(self) -> torch.Tensor:
        """1 + weight in float32, the native op's weight (models/families/native_stack.py takes it)."""
        if self._scale is None or self._scale[0] != self.weight._version:
            scale = self.weight.detach().float() + 1.0
            self._scale = (self.weight._version, scale, torch.cat([scale, scale]))
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale()
        if self.native and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return native.rms_norm(x, scale, self.eps)
        size = self.weight.shape[-1]
        return F.layer_norm(torch.cat([x, -x], dim=-1), (2 * size,), self._scale[2], None, self.eps)[..., :size].contiguous()


class HeadsNorm(ForwardWithoutHooks, torch.nn.Module):
    """q's and k's per-head norms (Qwen3, Gemma 3) as one op on their adjacent columns: x [T, H + KV, D]
    normed over D, query heads with q_norm's weight and key heads with k_norm's: the numbers of the
    two norms applied one after the other, in half the ops; natively one op (`native`)."""

    def __init__(self, q_norm: torch.nn.Module, k_norm: torch.nn.Module, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.gemma = isinstance(q_norm, GemmaRMSNorm)

        def weight(norm):
            return norm.weight.detach().float() + 1.0 if self.gemma else norm.weight.detach()

        self.weight = torch.cat([weight(q_norm).expand(num_heads, -1), weight(k_norm).expand(num_kv_heads, -1)])
        self.eps = q_norm.eps
        self.native = False  # the native op serves (`use_native`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.native and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and self.weight.dtype in (x.dtype, torch.float32)):
            return native.rms_norm(x, self.weight, self.eps)
        if self.gemma:
            return F.rms_norm(x.float(), x.shape[-1:], None, self.eps).mul_(self.weight).to(x.dtype)
        x32 = x.float()
        rstd = x32.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        x32 = x32 * rstd if x32 is x else x32.mul_(rstd)
        return x32.to(x.dtype).mul_(self.weight)


def add_and_norm(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): one native pass where `norm` is a native RMSNorm, else
    the sum in place in x (x.add_(residual), as the decoder layer adds) and the norm of it."""
    if isinstance(norm, RMSNorm) and norm._native_serves(x) and residual.dtype == x.dtype:
        return native.add_rms_norm(x, residual, norm.weight, norm.eps)
    h = x.add_(residual)
    return norm(h), h


def use_native(module: torch.nn.Module) -> None:
    """The native fused ops serve `module`'s RMSNorms (Gemma's and the per-head ones too) and its
    SiLU- and GELU(tanh)-gated MLPs (the native kernels are loaded: the model's attention backend is
    the native one)."""
    for sub in module.modules():
        if hasattr(sub, "native") and isinstance(getattr(sub, "native"), bool):
            sub.native = True


def make_norm(kind: str, size: int, eps: float) -> torch.nn.Module:
    """kind: "rms" | "gemma_rms" | "layer" (a FamilyStructure.norm)."""
    if kind == "rms":
        return RMSNorm(size, eps)
    if kind == "gemma_rms":
        return GemmaRMSNorm(size, eps)
    if kind == "layer":
        return LayerNorm(size, eps=eps)
    raise ValueError(f"unknown norm {kind!r}")
