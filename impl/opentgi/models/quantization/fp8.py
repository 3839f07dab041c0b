"""FP8 (e4m3) weights with a scale per output channel, multiplied by `torch._scaled_mm` on GPUs
that have FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell).

Each step's activations are quantized to FP8 row by row (one scale per row, from the row's own
maximum), so a row's numbers depend on that row alone. `reference_matmul` computes what the kernel
computes, in float32, on any device: the CPU tests check the quantization and the layout through
it, as tests/models/test_flash_backend.py checks flash-attn's.
"""

from __future__ import annotations

import torch

from opentgi.models.quantization.single_thread_cat import cat_on_one_thread

FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_MAX = 448.0  # largest finite e4m3fn value


def fp8_available(device: torch.device) -> bool:
    if FP8 is None or device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in FP8, float32 scale [rows, 1]) with `x ~= values * scale` row by row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12)
    scale = amax / _FP8_MAX
    return (x.float() / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(FP8), scale


class Fp8Weight:
    """A linear's weight as FP8 [N, K] and a float32 scale per output channel."""

    kind = "fp8"
    description = "fp8 e4m3 (per channel, activations per row)"

    def __init__(self, weight: torch.Tensor, device: torch.device):
        if FP8 is None:
            raise ValueError("this torch build has no float8_e4m3fn")
        self.out_features, self.in_features = weight.shape
        self.device = torch.device(device)
        q, scale = quantize_rows(weight)
        self.q = q.to(self.device)
        self.scale = scale.T.contiguous().to(self.device)  # [1, N], as _scaled_mm's scale_b

    def can_cat(self, others: list[Fp8Weight]) -> bool:
        return all(o.in_features == self.in_features and o.device == self.device for o in others)

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        fused = object.__new__(Fp8Weight)
        fused.in_features, fused.device = parts[0].in_features, parts[0].device
        fused.out_features = sum(p.out_features for p in parts)
        fused.q = cat_on_one_thread([p.q for p in parts])
        fused.scale = cat_on_one_thread([p.scale for p in parts], dim=1)
        return fused

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.T

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.device.type == "cuda":
            xq, x_scale = quantize_rows(rows)
            out = torch._scaled_mm(xq, self.q.T, scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype)
        else:
            out = reference_matmul(rows, self).to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)


def reference_matmul(rows: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """What `_scaled_mm` computes for `rows` (float32 [M, N]): FP8 rows times FP8 weight, scaled."""
    xq, x_scale = quantize_rows(rows)
    return (xq.float() @ weight.q.float().T) * x_scale * weight.scale
