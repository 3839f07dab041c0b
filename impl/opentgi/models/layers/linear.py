"""Linear layers through oneDNN on CPU.

torch's CPU wheels run a float32 `F.linear` through MKL's sgemm, which takes a slow path on AMD
CPUs; oneDNN (bundled with torch as "mkldnn") compiles its kernels for the instructions the CPU
really has. On the 2-core AMD EPYC machine this project is built on (1 thread, side by side), the
121 matmuls of one SmolLM2-135M step ran 2.2x faster with 16 rows (a batch-16 decode) and 2.4x
with 256 rows (a prefill chunk). Each weight is reordered once into oneDNN's blocked layout and the
dense copy dropped, so the model takes no extra memory.

In bfloat16 (the default on CPUs with avx512_bf16 or AMX, see models/loader.py) oneDNN's packed
kernels also beat `F.linear`: measured side by side, 1 thread, one row (a single-stream decode),
the 3072x576 gate/up projection of SmolLM2-135M 287 -> 218 us, the 576x1536 down projection
106 -> 48 us, the 49152x576 LM head 3.6 -> 2.3 ms.

Used only where it computes what `F.linear` computes: CPU, float32 or bfloat16, and a probe at
start-up that compares the two (results differ only by summation order and rounding).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_PACK_ROWS = 16  # oneDNN's hint for the expected row count; measured not to matter for speed


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS)


class OneDNNLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = _pack(weight)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}  # of the start-up probe, per dtype


def onednn_linear_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """True where OneDNNLinear runs and agrees with F.linear (CPU, float32 or bfloat16, mkldnn
    built in)."""
    if device.type != "cpu" or dtype not in _TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
        x = torch.randn(5, 40, generator=gen)
        expected = F.linear(x, weight, bias)  # in float32
        with torch.inference_mode():
            got = OneDNNLinear(weight.to(dtype), bias.to(dtype))(x.to(dtype)).float()
        return torch.allclose(got, expected, atol=_TOLERANCE[dtype], rtol=_TOLERANCE[dtype])
    except Exception:  # noqa: BLE001 - an old or odd build: the plain matmul serves
        log.warning("oneDNN linear unavailable; using torch's default matmul", exc_info=True)
        return False


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by a OneDNNLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, OneDNNLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count
