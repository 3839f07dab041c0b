"""4-bit weights in groups: `w[n, j] = (k[n, j] - 8) * scale[n, g] + zero[n, g]` for the group g of
`group_size` inputs that j falls in, k in 0..15.

This is the form torch's int4 kernels take: `_weight_int4pack_mm_for_cpu` on CPU and the tinygemm
kernel `_weight_int4pack_mm` on CUDA, both with scales and zeros in the activations' dtype. GGUF's
Q4_0, Q4_1 and Q4_K blocks (models/quantization/ggml.py), AWQ and GPTQ checkpoints
(models/quantization/awq_gptq.py) and `--quantize int4` (models/quantization/rtn.py) all arrive as
`Int4Groups` and are served by `Int4Weight`.

On CPU, float32 activations go through the kernel as bfloat16 (`kernel_dtype`): torch's CPU int4
kernel is 5-25x slower with float32 activations than with bfloat16 ones, slower than a dense float32
matmul of the same weight, so a float32 host (no native bfloat16, models/loader.py) converts each row
to bfloat16, multiplies, and converts the result back; scales and zeros are held in bfloat16.

A row's result does not depend on the other rows of the step: the CPU kernel computes each row with
the same reduction order whatever the row count (tests/models/test_quantization_formats.py checks M=1
against M=k bit for bit), so every step, prompt or decode, multiplies through the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentgi.models.quantization.single_thread_cat import cat_on_one_thread

_CPU_LAYOUT_TILES = 1  # inner_k_tiles of the CPU layout (ignored by the CPU packer)
_CUDA_INNER_K_TILES = 8  # tinygemm's layout; 8 is what gpt-fast and torchao use
GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class Int4Groups:
    """4-bit values (uint8, one a byte: a loading step, packed at once by `Int4Weight`) with a
    float32 scale and zero per group of `group_size` inputs of an output row."""

    values: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K / group_size]
    zero: torch.Tensor  # float32 [N, K / group_size]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @staticmethod
    def from_values(k: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> Int4Groups:
        """From k (any integer dtype, values 0..15, [N, K])."""
        return Int4Groups(k.to(torch.uint8).contiguous(), scale.float().contiguous(), zero.float().contiguous(),
                          group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] these groups stand for."""
        n, k = self.shape
        groups = self.values.view(n, k // self.group_size, self.group_size).float() - 8
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> Int4Groups:
        """The output rows `index` (a permutation or a slice of them)."""
        return Int4Groups(self.values[index], self.scale[index], self.zero[index], self.group_size)

    def to_format(self, dtype: torch.dtype, device: torch.device) -> Int4Weight:
        return Int4Weight(self, dtype, device)


def kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The activation (and scale) dtype the int4 kernel runs in for a model served in `dtype`."""
    return torch.bfloat16 if torch.device(device).type == "cpu" and dtype == torch.float32 else dtype


def int4_kernel_available(device: torch.device) -> bool:
    if device.type == "cuda":
        return hasattr(torch, "_weight_int4pack_mm") and hasattr(torch, "_convert_weight_to_int4pack")
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def pack_for_cuda(groups: Int4Groups) -> torch.Tensor:
    """tinygemm's input: uint8 [N, K / 2] with the even input in the HIGH nibble (torchao's order);
    `torch._convert_weight_to_int4pack` then tiles it."""
    k = groups.values
    return (k[:, 0::2] << 4 | k[:, 1::2]).contiguous()


def _pack_for_cpu_blocks(values: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 layout for N a multiple of 64, built from uint8 values (torch's packer
    wants int32 values, four times the bytes): each block of 64 output rows is stored input by
    input, 32 bytes per input, byte d holding row d (low nibble) and row 32 + d (high nibble)."""
    n, k = values.shape
    blocks = values.view(n // 64, 2, 32, k)
    return (blocks[:, 0] | (blocks[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


_CPU_BLOCK_LAYOUT: list[bool] = []  # [whether _pack_for_cpu_blocks matches this torch's packer]


def cpu_block_layout_matches() -> bool:
    if not _CPU_BLOCK_LAYOUT:
        probe = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        expected = torch._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), _CPU_LAYOUT_TILES)
        _CPU_BLOCK_LAYOUT.append(expected.dtype == torch.uint8 and torch.equal(_pack_for_cpu_blocks(probe), expected))
    return _CPU_BLOCK_LAYOUT[0]


def pack_for_cpu(groups: Int4Groups) -> torch.Tensor:
    values = groups.values
    if values.shape[0] % 64 == 0 and cpu_block_layout_matches():
        return _pack_for_cpu_blocks(values)
    return torch._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), _CPU_LAYOUT_TILES)


def scales_and_zeros(groups: Int4Groups, dtype: torch.dtype) -> torch.Tensor:
    """[K / group_size, N, 2] (scale, zero) in `dtype`, as both kernels want them."""
    n, num_groups = groups.scale.shape
    out = torch.empty(num_groups, n, 2, dtype=dtype)
    out[..., 0] = groups.scale.T
    out[..., 1] = groups.zero.T
    return out


class Int4Weight:
    """A linear's weight as 4-bit groups in the layout of torch's int4 kernel for its device."""

    kind = "int4"

    def __init__(self, groups: Int4Groups, dtype: torch.dtype, device: torch.device):
        if groups.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size {groups.group_size} (the kernels take {GROUP_SIZES})")
        self.out_features, self.in_features = groups.shape
        self.group_size = groups.group_size
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.packed = torch._convert_weight_to_int4pack(pack_for_cuda(groups).to(self.device),
                                                            _CUDA_INNER_K_TILES)
        else:
            self.packed = pack_for_cpu(groups)
        self.scales_and_zeros = scales_and_zeros(groups, kernel_dtype(self.device, dtype)).to(self.device)

    @staticmethod
    def from_packed(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                    device: torch.device) -> Int4Weight:
        """A weight packed before (models/checkpoints/packed_cache.py)."""
        weight = object.__new__(Int4Weight)
        dtype = kernel_dtype(torch.device(device), scales_and_zeros.dtype)
        weight.packed, weight.scales_and_zeros = packed.to(device), scales_and_zeros.to(device, dtype)
        weight.group_size, weight.device = group_size, torch.device(device)
        weight.out_features = scales_and_zeros.shape[1]
        weight.in_features = scales_and_zeros.shape[0] * group_size
        return weight

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @property
    def description(self) -> str:
        return f"int4 (groups of {self.group_size})"

    def _rows_per_tile(self) -> int:
        return 8 if self.device.type == "cuda" else 64

    def can_cat(self, others: list[Int4Weight]) -> bool:
        """Whether stacking the packed forms along the output equals packing the stacked weights:
        both layouts tile whole blocks of output rows (64 on CPU, 8 on CUDA)."""
        parts = [self, *others]
        return (len({(p.group_size, p.in_features, p.device, p.scales_and_zeros.dtype) for p in parts}) == 1
                and all(p.out_features % p._rows_per_tile() == 0 for p in parts)
                and (self.device.type == "cuda" or cpu_block_layout_matches()))

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        fused = object.__new__(Int4Weight)
        fused.in_features, fused.group_size, fused.device = parts[0].in_features, parts[0].group_size, parts[0].device
        fused.out_features = sum(p.out_features for p in parts)
        fused.packed = cat_on_one_thread([p.packed for p in parts])
        fused.scales_and_zeros = cat_on_one_thread([p.scales_and_zeros for p in parts], dim=1)
        return fused

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for x [..., in_features] in the serving dtype."""
        rows = x.reshape(-1, self.in_features).to(self.activation_dtype)
        if self.device.type == "cuda":
            out = torch._weight_int4pack_mm(rows, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
