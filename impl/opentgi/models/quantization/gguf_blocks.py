"""A GGUF linear served on the file's own blocks by the native kernel (opentgi.kernels).

`GGUFBlocks` is the loading step: the tensor's rows of blocks, a view of the memory-mapped file
(no copy, no dequantized values), with the row order llama.cpp's q/k permutation needs undone;
`GGUFBlockWeight` is the format a QuantizedLinear holds, and `GGUFEmbedding` looks token rows
up in the same blocks (the tied head and the embedding share them). Only a permuted q/k and a fused
projection (q, k, v or gate, up stacked into one weight) are copies, of the same bytes. Each row of
activations is quantized to 8-bit blocks from its own values and every output sums its blocks in
one fixed order (kernels/csrc/common.h), so a row's bits never depend on the step's other rows
or on the thread count.
"""

from __future__ import annotations

import ctypes
import mmap
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from opentgi.kernels import native
from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.quantization import ggml
from opentgi.models.quantization.linear import QuantizedLinear
from opentgi.models.quantization.single_thread_cat import cat_on_one_thread

NATIVE_TYPES = frozenset(native.BLOCK_TYPES)  # GGML type ids the kernel multiplies
# Projections whose activations are quantized to ~16 bits (`passes=2`, kernels.native.gguf_mm:
# 16-bit activation blocks where the type has a wide kernel, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K; else
# two 8-bit passes, the residual of the first rounding quantized and multiplied too): q/k/v,
# whose inputs' 8-bit rounding the attention logits amplify, and the MLP's down projection, whose
# gated input is heavy-tailed. On the default model these two carry most of the 8-bit rounding's
# perplexity cost at about a third of its layers' weights (docs/benchmarks.md); the rest keep one.
TWO_PASS = re.compile(r"\.(q_proj|k_proj|v_proj|qkv_proj|down_proj|w2)\.weight$")


def activation_passes(name: str) -> int:
    """How many passes the native kernel quantizes the activations of `name` in (2: ~16 bits)."""
    return 2 if TWO_PASS.search(name) else 1


def _as_tensor(raw: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # the map is read-only; the kernel never writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


@dataclass
class GGUFBlocks:
    raw: np.ndarray  # uint8 [N, bytes per row], a view of the file
    qtype: int  # GGML type id
    shape: tuple[int, int]  # (N, K)
    order: torch.Tensor | None = None  # row r is the file's row order[r]

    def rows(self, index: torch.Tensor) -> GGUFBlocks:
        order = index if self.order is None else self.order[index]
        return GGUFBlocks(self.raw, self.qtype, self.shape, order)

    def to_format(self, dtype: torch.dtype, device: torch.device) -> GGUFBlockWeight:
        if torch.device(device).type != "cpu":
            raise ValueError("GGUF blocks are served by the native CPU kernel only")
        blocks = _as_tensor(np.asarray(self.raw).reshape(self.shape[0], -1))
        if self.order is not None:
            return GGUFBlockWeight(blocks.index_select(0, self.order), self.qtype, self.shape[1])
        return GGUFBlockWeight(blocks, self.qtype, self.shape[1], mapped=True)


class GGUFBlockWeight:
    """A weight as GGML blocks, multiplied by `opentgi::gguf_mm`."""

    kind = "gguf"

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, passes: int = 1, mapped: bool = False):
        self.blocks, self.qtype = blocks, int(qtype)
        self.mapped = mapped  # a view of the file's memory map (fuse_linears keeps such weights as parts)
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.device = torch.device("cpu")
        self.passes = passes  # activation quantization passes (kernels.native.gguf_mm)

    @property
    def description(self) -> str:
        path = native.loaded()
        isa = path.isa if path else "?"
        if self.qtype in native.DENSE_TYPES:
            return f"{native.DENSE_TYPES[self.qtype][0]} rows (native {isa})"
        for file_type, repacked in native.BY_16_ROWS.items():
            if self.qtype == repacked:
                return f"{native.BLOCK_TYPES[file_type][0]} blocks by 16 rows (native {isa})"
        return f"{native.BLOCK_TYPES[self.qtype][0]} blocks (native {isa})"

    def can_cat(self, others: list[GGUFBlockWeight]) -> bool:
        return all(o.qtype == self.qtype and o.in_features == self.in_features and o.passes == self.passes
                   for o in others)

    @staticmethod
    def cat(parts: list[GGUFBlockWeight]) -> GGUFBlockWeight:
        return GGUFBlockWeight(cat_on_one_thread([p.blocks for p in parts]), parts[0].qtype, parts[0].in_features,
                               parts[0].passes)

    def nbytes(self) -> int:
        return self.blocks.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return native.gguf_mm(x, self.blocks, self.qtype, self.out_features, passes=self.passes)


def native_dense_linear(weight: torch.Tensor) -> QuantizedLinear | None:
    """A dense CPU weight [N, K] of a dtype the native kernels multiply (`native.DENSE_TYPES`) as a
    QuantizedLinear on their dense rows (csrc/dense.cpp: each output's sum in one fixed order),
    holding the weight's own bytes; None where the kernels are not loaded or cannot take it."""
    qtype = native.DENSE_TYPE_OF.get(weight.dtype)
    if (qtype is None or weight.dim() != 2 or weight.device.type != "cpu" or native.loaded() is None
            or weight.shape[1] % native.DENSE_TYPES[qtype][1]):
        return None
    out_features, in_features = weight.shape
    linear = QuantizedLinear(in_features, out_features)
    linear.weight_format = GGUFBlockWeight(weight.detach().contiguous().view(torch.uint8).reshape(out_features, -1),
                                           qtype, in_features)
    return linear


def passes_by_16_rows(dtype: torch.dtype) -> dict[int, tuple[int, ...]]:
    """GGML type -> the activation passes at which a model served here in `dtype` holds that type
    repacked by sixteen rows (kernels.native.BY_16_ROWS: the same bytes, moved), so that the
    kernels' sixteen-output forms read their vectors whole instead of transposing sixteen rows'
    bytes a block (docs/quantization.md). Where the AVX-512 variant runs: every block type's
    weights at both passes (their kernels on the groups give the file's layout's bits), but Q6_K's:
    only at `passes=2` (v and down of a Q4_K_M file) where the model runs in bfloat16 on a CPU with
    AVX-512 BF16, for the rows' own bfloat16 values against the blocks."""
    path = native.loaded()
    if path is None or path.name != "native" or path.isa != "avx512":
        return {}
    wanted = {GGMLQuantizationType(t): (1, 2) for t in native.BY_16_ROWS if t != GGMLQuantizationType.Q6_K}
    if dtype == torch.bfloat16 and native.takes_bf16_rows():
        wanted[GGMLQuantizationType.Q6_K] = (2,)
    return wanted


def repack_by_16_rows(modules: nn.Module, dtype: torch.dtype) -> int:
    """The weights under `modules` (a model's layers, its LM head) that `passes_by_16_rows` names,
    repacked by sixteen rows (routed experts too: a SparseMoE groups its experts' weights again
    after, `group_experts`). The file's pages under a repacked weight are released from the process (a tied head's
    are the embedding's too: the rows it looks up are mapped again as it reads them). Returns the
    bytes repacked."""
    wanted = passes_by_16_rows(dtype)
    repacked = 0
    for name, module in modules.named_modules():
        fmt = getattr(module, "weight_format", None)
        if (type(fmt) is not GGUFBlockWeight or fmt.passes not in wanted.get(fmt.qtype, ())
                or fmt.out_features % 16):
            continue
        blocks = native.repack_by_16_rows(fmt.blocks, fmt.qtype, fmt.in_features)
        if fmt.mapped:
            _release_pages(fmt.blocks)
        fmt.blocks, fmt.qtype, fmt.mapped = blocks, native.BY_16_ROWS[fmt.qtype], False
        repacked += blocks.nbytes
    return repacked


def _release_pages(view: torch.Tensor) -> None:
    """Unmap the whole pages under `view` (a view of the file's read-only memory map) from this
    process: the page cache keeps them, and reading them again maps them again."""
    start, end = view.data_ptr(), view.data_ptr() + view.nbytes
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


class GGUFEmbedding(ForwardWithoutHooks, nn.Module):
    """A token embedding held as the file's blocks: the rows looked up are dequantized as
    `ggml.dense` dequantizes them (the values a dense copy would hold), each row on its own."""

    def __init__(self, blocks: GGUFBlocks, dtype: torch.dtype):
        super().__init__()
        self.gguf_blocks = _as_tensor(np.asarray(blocks.raw).reshape(blocks.shape[0], -1))  # not a buffer
        self.qtype = GGMLQuantizationType(blocks.qtype)
        self.num_embeddings, self.embedding_dim = blocks.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype == GGMLQuantizationType.Q8_0:
            return self._q8_0(ids)
        rows = self.gguf_blocks.index_select(0, ids.reshape(-1))
        values = ggml.dense(rows.numpy(), self.qtype, (rows.shape[0], self.embedding_dim))
        return values.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def _q8_0(self, ids: torch.Tensor) -> torch.Tensor:
        """Q8_0 rows as `ggml.dense` computes them (float32 q times the float16 d as float32, one
        rounding), in numpy alone: a decode step looks up a row or a few, where each torch op
        costs more than the numbers."""
        blocks = self.gguf_blocks.numpy().reshape(self.num_embeddings, -1, 34)[ids.numpy().reshape(-1)]
        values = blocks[..., 2:].view(np.int8).astype(np.float32)
        values *= blocks[..., :2].copy().view(np.float16).astype(np.float32)
        out = torch.from_numpy(values.reshape(-1, self.embedding_dim))
        if self.dtype != torch.float32:
            out = out.to(self.dtype)
        return out if ids.dim() == 1 else out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} blocks"
