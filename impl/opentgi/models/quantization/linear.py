"""A linear layer whose weight is a quantized format (int4 groups, int8 per channel, fp8), fusing
such layers, and the one-line account of what a model holds resident.

A weight is its format: `QuantizedLinear` multiplies every row of every step through its format's
kernel, prompt rows and generated rows alike, so a row's numbers never depend on how many rows
share the step (the kernels compute rows independently; tests/test_quantization_formats.py).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


class QuantizedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in a quantized format (`Int4Weight`, `Int8Weight`, `Fp8Weight`),
    set by the loader (models/checkpoints/loading.py)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_format = None
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_format.matmul(x)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        kind = self.weight_format.description if self.weight_format is not None else "unpacked"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class ConcatLinear(nn.Module):
    """Projections that cannot be stacked into one weight (different formats), run one after the
    other and concatenated along the output, as one fused projection would."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse_linears(parts: list[nn.Module]) -> nn.Module:
    """One module computing the concatenated outputs of `parts` (nn.Linear or QuantizedLinear)."""
    first = parts[0]
    has_bias = getattr(first, "bias", None) is not None
    if all(isinstance(p, nn.Linear) for p in parts):
        fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias,
                          device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if has_bias:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        return fused
    formats = [p.weight_format for p in parts if isinstance(p, QuantizedLinear)]
    if (len(formats) == len(parts) and len({type(f) for f in formats}) == 1
            and formats[0].can_cat(formats[1:])):
        bias = torch.cat([p.bias for p in parts]) if has_bias else None
        fused = QuantizedLinear(first.in_features, sum(p.out_features for p in parts), bias)
        fused.weight_format = type(formats[0]).cat(formats)
        return fused
    return ConcatLinear(parts)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def resident_summary(model: nn.Module) -> str:
    """One line: each weight format held, how many linears and bytes, and the total."""
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    seen: set[int] = set()

    def add(kind: str, nbytes: int, linear: bool) -> None:
        entry = by_kind[kind]
        entry[0] += int(linear)
        entry[1] += nbytes

    for sub in model.modules():
        if isinstance(sub, QuantizedLinear):
            add(sub.weight_format.description, sub.weight_format.nbytes(), True)
            if sub.bias is not None:
                add(str(sub.bias.dtype).replace("torch.", ""), _tensor_bytes(sub.bias), False)
            continue
        packed = getattr(sub, "packed", None)  # OneDNNLinear (models/layers/linear.py)
        if isinstance(packed, torch.Tensor) and id(packed) not in seen:
            seen.add(id(packed))
            add(f"{str(packed.dtype).replace('torch.', '')} (oneDNN)", _tensor_bytes(packed), True)
        for tensor in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            linear = isinstance(sub, nn.Linear) and tensor is sub.weight
            add(str(tensor.dtype).replace("torch.", ""), _tensor_bytes(tensor), linear)
        bias = getattr(sub, "bias", None)
        if packed is not None and isinstance(bias, torch.Tensor) and id(bias) not in seen:
            seen.add(id(bias))
            add(str(bias.dtype).replace("torch.", ""), _tensor_bytes(bias), False)
    total = sum(nbytes for _, nbytes in by_kind.values())
    parts = [f"{kind} {nbytes / 2**20:,.0f} MiB" + (f" ({count} linears)" if count else "")
             for kind, (count, nbytes) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])]
    return f"resident weights: {', '.join(parts)}; total {total / 2**20:,.0f} MiB"
