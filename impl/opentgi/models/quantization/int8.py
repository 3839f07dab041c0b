"""8-bit weights, one scale per output channel: `w[n, j] = q[n, j] * scale[n]`, q in -127..127.

Served by torch's `_weight_int8pack_mm` (x in the serving dtype, the weight read as int8: half the
bytes of bfloat16). Like the int4 kernel, it computes each row alone, so a row's result does not
depend on the step's row count (tests/models/test_quantization_formats.py). Where the kernel is missing
(an old build, or a device without it), `x @ q.T` runs through `F.linear` on the fly-converted
weight, scaled after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opentgi.models.quantization.single_thread_cat import cat_on_one_thread


def int8_kernel_available(device: torch.device) -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Weight:
    """A linear's weight as int8 [N, K] with a scale per output channel."""

    kind = "int8"
    description = "int8 (per channel)"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device):
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError("Int8Weight wants int8 [N, K] values and one scale per output row")
        self.out_features, self.in_features = q.shape
        self.device = torch.device(device)
        self.q = q.contiguous().to(self.device)
        self.scale = scale.to(dtype).to(self.device)
        self.use_kernel = int8_kernel_available(self.device)

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def can_cat(self, others: list[Int8Weight]) -> bool:
        return all(o.in_features == self.in_features and o.device == self.device for o in others)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        first = parts[0]
        return Int8Weight(cat_on_one_thread([p.q for p in parts]), cat_on_one_thread([p.scale for p in parts]),
                          first.scale.dtype, first.device)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.use_kernel:
            try:
                out = torch._weight_int8pack_mm(rows, self.q, self.scale)
            except (RuntimeError, NotImplementedError):  # no kernel for this device/dtype in this build
                self.use_kernel = False
                out = F.linear(rows, self.q.to(rows.dtype)) * self.scale
        else:
            out = F.linear(rows, self.q.to(rows.dtype)) * self.scale
        return out.view(*x.shape[:-1], self.out_features)
