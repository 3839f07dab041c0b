"""The linear kernels this CPU serves, for tests that must check the path the host really runs.

oneDNN's packed bfloat16 linear needs avx512bw, avx512vl and avx512dq (or avx_ne_convert); on a
CPU without them (an AVX2-only one) `onednn_linear_usable` says no and the paged model serves
bfloat16 through `RowTiledLinear` (models/layers/linear.py). Tests about oneDNN's own bfloat16
kernel skip that one case there, with `NO_ONEDNN_BF16` as the reason; invariance tests run on
the kernel the host serves.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from opentgi.models.layers.linear import (
    OneDNNLinear,
    RowTiledLinear,
    onednn_linear_usable,
    pack_linears,
    tile_linears,
)
from opentgi.models.quantization.int4 import cpu_block_layout_matches
from opentgi.models.quantization.linear import QuantizedLinear

NO_ONEDNN_BF16 = "this CPU has no oneDNN bfloat16 kernel (needs avx512bw/vl/dq or avx_ne_convert)"


@functools.cache
def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether the product runs this dtype's dense linears through oneDNN on this CPU."""
    return onednn_linear_usable(torch.device("cpu"), dtype)


def needs_onednn(dtype: torch.dtype) -> pytest.MarkDecorator:
    """Skip a case that is about oneDNN's kernel for `dtype` where this CPU has none."""
    return pytest.mark.skipif(not onednn_serves(dtype), reason=NO_ONEDNN_BF16 if dtype == torch.bfloat16
                              else f"this CPU has no oneDNN {dtype} linear kernel")


def onednn_param(dtype: torch.dtype):
    """`dtype` as a parametrize case that needs oneDNN's kernel for it."""
    return pytest.param(dtype, marks=needs_onednn(dtype))


def served_linear_class(dtype: torch.dtype) -> type:
    """The class a batch-invariant paged model on this CPU holds its dense linears in."""
    return OneDNNLinear if onednn_serves(dtype) else RowTiledLinear


def served_linear_classes(dtype: torch.dtype) -> list[type]:
    """The row-invariant linear classes this CPU can run in `dtype`: RowTiledLinear always,
    OneDNNLinear where oneDNN has a kernel."""
    return [OneDNNLinear, RowTiledLinear] if onednn_serves(dtype) else [RowTiledLinear]


def cpu_flags() -> set[str] | None:
    """The CPU's flags (Linux /proc/cpuinfo), or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[-1].split())
    return None


def cpu_has_onednn_bf16_instructions() -> bool | None:
    """Whether the CPU has the instructions oneDNN's bfloat16 reorder asks for; None if unknown."""
    flags = cpu_flags()
    if flags is None:
        return None
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def serve_linears(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace the nn.Linears inside `module` by the row-invariant linears a batch-invariant paged
    model holds on this CPU (models/families/decoder.py): oneDNN's where it has a kernel for
    `dtype`, else row-tiled F.linear. Returns how many."""
    if onednn_serves(dtype):
        return pack_linears(module, row_invariant=True)
    return tile_linears(module)


def int4_weights_stack() -> bool:
    """Whether CPU int4 projections of whole 64-row blocks are stacked into one weight here: where
    torch packs them in the 64-row block layout the product recognises (its AVX-512 kernels). Its
    AVX2 kernels pack 32-row blocks, which the product does not stack (models/quantization/int4.py
    `cpu_block_layout_matches`): such projections run side by side, each through the int4 kernel."""
    return cpu_block_layout_matches()


def int4_projections(linear: torch.nn.Module) -> list:
    """The modules a (fused) projection is served by: itself where its parts were stacked into one
    QuantizedLinear, else the parts of its ConcatLinear."""
    return [linear] if isinstance(linear, QuantizedLinear) else list(linear.parts)


def torch_runs_avx512_kernels() -> bool:
    """Whether torch dispatches its CPU kernels to their AVX-512 builds here (not AVX2's): some
    bitwise coincidences hold only on one of them."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
