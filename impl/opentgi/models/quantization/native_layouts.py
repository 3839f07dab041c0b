"""`--quantize int8|int4`, AWQ and GPTQ weights in the native kernels' block layouts.

Where the native kernels serve (CPU, `--kernels auto|native` with a compiler: opentgi.kernels), a
weight quantized at load time or read from an AWQ/GPTQ checkpoint is held as GGML blocks and
multiplied by the same kernel as a GGUF's own blocks (`GGUFBlockWeight`), whose rows never depend
on the step's other rows:

- `--quantize int8` becomes Q8_0, llama.cpp's 8-bit format: a float16 scale per 32 inputs,
  `d = max|w| / 127` rounded to float16 first and the values rounded against the scale served (no
  gain error), so it is finer than one scale per channel at 1/16 more bytes.
- int4 groups (`(k - 8) * s + zero`, from `--quantize int4[-gN]`, AWQ or GPTQ) become Q4_1
  (`w = d * q + m` per 32 inputs) holding the same values: `d = s`, `m = zero - 8 s`, both rounded
  to float16 (the one change to the values), a larger group's scale and zero repeated in each of
  its 32-input blocks.

torch's int8 CPU kernel takes float32 activations far slower than bfloat16 ones, and its int4 kernel
wants bfloat16 ones (docs/benchmarks.md), so on a CPU without native bfloat16 (where float32 is
served) these layouts keep a quantized model faster than its dense weights. Weights whose inputs are
not whole blocks of 32 keep torch's formats.
"""

from __future__ import annotations

import torch

from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight
from opentgi.models.quantization.int4 import Int4Groups

Q4_1, Q8_0 = 3, 8  # GGML type ids
BLOCK = 32


class NativeBlocks:
    """A loading step: a weight as GGML blocks of `qtype` (uint8 [N, row bytes]), built here."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int):
        self.blocks, self.qtype, self.in_features = blocks, qtype, in_features

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.in_features)

    def to_format(self, dtype: torch.dtype, device: torch.device) -> GGUFBlockWeight:
        if torch.device(device).type != "cpu":
            raise ValueError("GGML blocks are served by the native CPU kernel only")
        return GGUFBlockWeight(self.blocks, self.qtype, self.in_features)


def q8_0_blocks(weight: torch.Tensor) -> NativeBlocks:
    """A float weight [N, K] (K a multiple of 32) as Q8_0 blocks."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // BLOCK, BLOCK)
    d = (groups.abs().amax(-1) / 127).to(torch.float16)
    safe = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    q = (groups / safe[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    out = torch.empty(n, k // BLOCK, 2 + BLOCK, dtype=torch.uint8)
    out[..., :2] = d.view(torch.uint8).view(n, k // BLOCK, 2)
    out[..., 2:] = q.view(torch.uint8)
    return NativeBlocks(out.view(n, -1), Q8_0, k)


def q4_1_blocks(groups: Int4Groups) -> NativeBlocks:
    """Int4 groups (any of int4.GROUP_SIZES) as Q4_1 blocks holding the same values."""
    n, k = groups.shape
    per = groups.group_size // BLOCK
    d = groups.scale.repeat_interleave(per, dim=1).to(torch.float16)
    m = (groups.zero - 8 * groups.scale).repeat_interleave(per, dim=1).to(torch.float16)
    values = groups.values.view(n, k // BLOCK, BLOCK)
    out = torch.empty(n, k // BLOCK, 4 + BLOCK // 2, dtype=torch.uint8)
    out[..., 0:2] = d.view(torch.uint8).view(n, k // BLOCK, 2)
    out[..., 2:4] = m.view(torch.uint8).view(n, k // BLOCK, 2)
    out[..., 4:] = values[..., : BLOCK // 2] | (values[..., BLOCK // 2:] << 4)
    return NativeBlocks(out.view(n, -1), Q4_1, k)


def in_native_layout(value, native_types: frozenset[int]):
    """`value` (a loading step: Int4Groups, or a float weight for `--quantize int8`) in the native
    layout where the native kernels serve its block type and its inputs are whole blocks; else
    `value` unchanged."""
    if isinstance(value, Int4Groups) and Q4_1 in native_types and value.shape[1] % BLOCK == 0:
        return q4_1_blocks(value)
    if isinstance(value, torch.Tensor) and Q8_0 in native_types and value.dim() == 2 \
            and value.shape[1] % BLOCK == 0:
        return q8_0_blocks(value)
    return value
