"""Linear layers through oneDNN on CPU.

torch's CPU wheels run a float32 `F.linear` through MKL's sgemm, which takes a slow path on AMD
CPUs; oneDNN (bundled with torch as "mkldnn") compiles its kernels for the instructions the CPU
really has, and its packed bfloat16 kernels beat `F.linear` too (docs/cpu.md, docs/benchmarks.md).
Each weight is reordered once into oneDNN's blocked layout and the dense copy dropped, so the model
takes no extra memory. Used only where it computes what `F.linear` computes: CPU, float32 or
bfloat16, and a start-up probe that compares the two (they differ only by summation order).

**Fewer than four rows are multiplied as four** (the last row repeated, its extra products
dropped): oneDNN's kernel for four rows is faster than its kernel for one, and a single-stream
decode step has one row (docs/benchmarks.md).

**Row invariance** (the default, docs/determinism.md): a row's product must not depend on how many
rows the step multiplies. oneDNN gives a lone row another kernel once the reduction is longer than
1024, and in float32 such weights also sum rows of even and odd batch positions differently. The
padding above keeps a lone row off its own kernel; in float32 a weight with K > 1024 can be held as
slices of 1024 inputs whose products are added in order. `find_row_invariant_form` probes, per
weight shape at start-up, the three forms (`RowInvariantForm`) in order and keeps the first that
gives random rows the same bits for row counts 1 to 64.
"""

from __future__ import annotations

import logging
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.layers.kernel_choices import KernelChoiceCache

log = logging.getLogger(__name__)

_PACK_ROWS = 16  # oneDNN's hint for the expected row count; it does not change the speed
_MIN_ROWS = 4  # fewer rows are multiplied as this many: faster, and a lone row's own kernel avoided
_K_SLICE = 1024  # float32: reductions longer than this are cut into slices added in order
_PROBE_ROW_COUNTS = (1, 2, 3, 4, 5, 7, 16, 17, 64)  # row counts a probe compares
kernel_choices = KernelChoiceCache()  # per shape; kept between starts once attached (kernel_choices.py)


class RowInvariantForm(str, Enum):
    """How a OneDNNLinear multiplies so that each row gets the same bits for every row count."""

    PADDED = "padded"  # fewer than `_MIN_ROWS` rows multiplied as that many
    PLAIN = "plain"  # every row count as it is
    K_SLICES = "k-slices"  # float32, padded, the reduction cut into slices of `_K_SLICE` added in order


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS)


class OneDNNLinear(ForwardWithoutHooks, nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = _pack(weight)
        self.bias = None if bias is None else bias.detach().clone()
        self.min_rows = _MIN_ROWS  # fewer rows are padded to this many (module docstring)
        self.k_slices: list[torch.Tensor] | None = None  # float32 row invariance: packed input slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self._rows_of(x)
        rows = x.shape[0]
        if rows >= self.min_rows or rows == 0:
            return self._product(x)
        # the last row repeated, by one cat of whole rows (cheaper than an expanded or `repeat`ed copy)
        padded = torch.cat((x,) * self.min_rows) if rows == 1 else torch.cat((x, *(x[-1:],) * (self.min_rows - rows)))
        return self._product(padded)[:rows]

    def _rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] of another rank than 2: its rows flattened (and padded) as one matrix."""
        return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.k_slices is not None:
            return self._sliced_forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _sliced_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        for i, part in enumerate(self.k_slices):
            piece = x[:, i * _K_SLICE:(i + 1) * _K_SLICE].contiguous()
            y = torch.ops.mkldnn._linear_pointwise(piece, part, None, "none", [], "")
            out = y if out is None else out.add_(y)
        return out if self.bias is None else out.add_(self.bias)

    def make_row_invariant(self, weight: torch.Tensor) -> str | None:
        """Switch to the form that computes each row alike for every row count (module
        docstring); `weight` is the dense weight this linear packed. Returns its `RowInvariantForm`
        value, or None where no form was found invariant (the padded one stays)."""
        # the padded row count is part of the key: a form probed with another one is probed again
        key = (self.out_features, self.in_features, weight.dtype, self.bias is not None, _MIN_ROWS)
        if key not in kernel_choices:
            kernel_choices[key] = find_row_invariant_form(*key[:3])
        form = kernel_choices[key]
        self.min_rows = 1 if form == RowInvariantForm.PLAIN else _MIN_ROWS
        if form == RowInvariantForm.K_SLICES:
            self.k_slices = _k_slices(weight)
            self.packed = None
        return form

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, min_rows={self.min_rows}")


def _k_slices(weight: torch.Tensor) -> list[torch.Tensor]:
    return [_pack(weight[:, s:s + _K_SLICE]) for s in range(0, weight.shape[1], _K_SLICE)]


def _rows_alike(linear: OneDNNLinear, x: torch.Tensor) -> bool:
    """Whether every row of `x` gets the same bits whatever the row count of the product."""
    reference = linear(x)
    for count in _PROBE_ROW_COUNTS:
        for start in range(0, x.shape[0] - count + 1, count):
            if not torch.equal(linear(x[start:start + count]), reference[start:start + count]):
                return False
    return True


def find_row_invariant_form(out_features: int, in_features: int,
                            dtype: torch.dtype) -> RowInvariantForm | None:
    """The first `RowInvariantForm`, in declaration order, found to give every row the same bits
    for row counts 1 to 64 on random data of this shape; None if none does (the padded form stays:
    the faster one)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).to(dtype)
    # bfloat16 outputs round most differences away: enough rows that some 2**16 outputs are compared
    rows = min(256, max(max(_PROBE_ROW_COUNTS), (1 << 16) // out_features))
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    probe = OneDNNLinear(weight)
    with torch.inference_mode():
        if _rows_alike(probe, x):
            return RowInvariantForm.PADDED
        probe.min_rows = 1
        if _rows_alike(probe, x):
            return RowInvariantForm.PLAIN
        probe.min_rows = _MIN_ROWS
        if dtype == torch.float32 and in_features > _K_SLICE:
            probe.k_slices, probe.packed = _k_slices(weight), None
            if _rows_alike(probe, x):
                return RowInvariantForm.K_SLICES
    log.warning("no row-invariant form of a %dx%d %s matmul found: rows of this weight may differ "
                "with the step's row count", out_features, in_features, dtype)
    return None



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
    except Exception as exc:  # noqa: BLE001 - a CPU or build without the kernel: the plain matmul serves
        log.info("oneDNN has no %s linear kernel here (%s); torch's matmul serves it",
                 str(dtype).removeprefix("torch."), str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False


_TILES = (64, 16, 4, 1)


class RowTiledLinear(ForwardWithoutHooks, nn.Module):
    """Row invariance where oneDNN's packed linear is not usable (a CPU without a oneDNN kernel
    for the dtype): `F.linear` on at most `tile` rows a call, a lone row multiplied as two (as
    OneDNNLinear), `tile` the largest of 64, 16, 4 and 1 probed at start-up to give every row
    the same bits for every row count (torch's own CPU kernels change blocking with the size)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        key = ("tiled", *weight.shape, weight.dtype, weight.device.type)
        if key not in kernel_choices:
            kernel_choices[key] = _invariant_tile(weight.shape[0], weight.shape[1], weight.dtype)
        self.tile = kernel_choices[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tiled_linear(x, self.weight, self.bias, self.tile)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tile={self.tile}"


def _tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    rows = x.shape[0]
    if rows == 1 and tile > 1:
        return F.linear(x.repeat(2, 1), weight, bias)[:1]
    if rows <= tile:
        return F.linear(x, weight, bias)
    return torch.cat([_tiled_linear(part, weight, bias, tile) for part in x.split(tile)])


def _invariant_tile(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).to(dtype)
    # bfloat16 outputs round most differences away: enough rows that some 2**16 outputs are compared
    x = torch.randn(min(1024, max(max(_TILES), (1 << 16) // out_features)), in_features, generator=gen).to(dtype)
    with torch.inference_mode():
        for tile in _TILES:
            reference = _tiled_linear(x, weight, None, tile)
            if all(torch.equal(_tiled_linear(x[s:s + count], weight, None, tile), reference[s:s + count])
                   for count in _PROBE_ROW_COUNTS
                   for s in range(0, x.shape[0] - count + 1, count)):
                return tile
    return 1


def tile_linears(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by a RowTiledLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, RowTiledLinear(child.weight, child.bias))
            count += 1
        else:
            count += tile_linears(child)
    return count


def pack_linears(module: nn.Module, row_invariant: bool = False) -> int:
    """Replace every nn.Linear inside `module` by a OneDNNLinear (in its row-invariant form with
    `row_invariant`); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            linear = OneDNNLinear(child.weight, child.bias)
            if row_invariant:
                linear.make_row_invariant(child.weight)
            setattr(module, name, linear)
            count += 1
        else:
            count += pack_linears(child, row_invariant)
    return count
