"""The decoder's feed-forward blocks.

- `GatedMLP`: `down(act(gate(x)) * up(x))`: SwiGLU (silu: Llama, Qwen, Mistral, Phi-3, each expert
  of Mixtral and Qwen3-MoE) and GeGLU (gelu_pytorch_tanh: Gemma). Checkpoints name the three
  projections differently (Mixtral's experts: w1/w3/w2) or store gate and up fused (Phi-3:
  gate_up_proj); after loading, gate and up are one `gate_up_proj` matmul either way.
- `PlainMLP`: `c_proj(act(c_fc(x)))` with biases (StarCoder2).
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.layers.elementwise import ACTIVATIONS, act_and_mul
from opentgi.models.quantization.linear import fuse_linears


def fused_linear(parts: list[nn.Module], copy_file_blocks: bool = False) -> nn.Module:
    """One module whose output is the concatenation of `parts`' outputs: one nn.Linear for dense
    parts, one QuantizedLinear for parts of a format that stacks (models/quantization/linear.py)."""
    return fuse_linears(parts, copy_file_blocks)


class GatedMLP(ForwardWithoutHooks, nn.Module):
    """names: the checkpoint's (gate, up, down) names, or ("gate_up_proj", None, down) when the
    checkpoint stores gate and up as one tensor (gate rows first)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False,
                 names: tuple[str, str | None, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.intermediate = intermediate
        self.act = ACTIVATIONS[act]
        self.act_name = act
        self.native = False  # silu-and-multiply as one native op (layers/norm.py's `use_native`)
        self.names = names
        gate, up, down = names
        if up is None:
            setattr(self, gate, nn.Linear(hidden, 2 * intermediate, bias=bias))
        else:
            setattr(self, gate, nn.Linear(hidden, intermediate, bias=bias))
            setattr(self, up, nn.Linear(hidden, intermediate, bias=bias))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=bias))

    def fuse_projections(self, copy_file_blocks: bool = False) -> None:
        gate, up, down = self.names
        if up is not None:
            self.gate_up_proj = fused_linear([getattr(self, gate), getattr(self, up)], copy_file_blocks)
            delattr(self, gate)
            delattr(self, up)
        elif gate != "gate_up_proj":
            self.gate_up_proj = self._modules.pop(gate)
        if down != "down_proj":
            self.down_proj = self._modules.pop(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.intermediate, self.act_name, self.native))


class PlainMLP(ForwardWithoutHooks, nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = True):
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.c_fc = nn.Linear(hidden, intermediate, bias=bias)
        self.c_proj = nn.Linear(intermediate, hidden, bias=bias)

    def fuse_projections(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))
