"""Round-to-nearest weight-only quantization at load time (`--quantize int8 | int4 | fp8`).

A float weight becomes int8 with one scale per output channel (`q = round(w / s)`,
`s = max|w| / 127` rounded to bfloat16, as the kernel takes it), int4 groups (`k = round((w - min) / d)`, `d = (max - min) / 15` per group of
`group_size` inputs, zero = min + 8 d, the form the int4 kernel takes), or FP8 e4m3 with one scale
per channel; `to_format` turns each into the format served, as it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentgi.models.quantization.fp8 import Fp8Weight
from opentgi.models.quantization.int4 import Int4Groups
from opentgi.models.quantization.int8 import Int8Weight


@dataclass
class Int8Rows:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def to_format(self, dtype: torch.dtype, device: torch.device) -> Int8Weight:
        return Int8Weight(self.q, self.scale, dtype, device)


@dataclass
class Fp8Rows:
    weight: torch.Tensor  # the float weight, quantized when served (Fp8Weight)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to_format(self, dtype: torch.dtype, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.weight, device)


def int8_rows(weight: torch.Tensor) -> Int8Rows:
    w = weight.detach().float()
    # the kernel takes the scales in the serving dtype: round them to bfloat16 first (exact in
    # float16 and float32 too) and round the weights against the scale that will be served, so a
    # channel carries no gain error (up to 0.2% in bfloat16) beside its rounding
    scale = (w.abs().amax(dim=1) / 127).clamp_(min=1e-12).to(torch.bfloat16).float()
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Rows(q, scale)


def int4_groups(weight: torch.Tensor, group_size: int) -> Int4Groups:
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"{k} inputs are not whole groups of {group_size}")
    groups = w.view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    values = ((groups - lo[..., None]) / safe[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Groups.from_values(values.view(n, k), d, lo + 8 * d, group_size)
