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

**Fewer than four rows are multiplied as four** (the last row repeated, its extra products
dropped): out of cache (30 layers' distinct weights, SmolLM2-135M's shapes, bfloat16, side by side)
oneDNN's kernels took less time for 4 rows than for 1: a layer's four projections 628 -> 561 us on
1 thread, 408 -> 354 us on 2, the LM head 4.6 -> 3.9 ms; 2 rows cost more than 1, 8 more than 4.
A single-stream decode step has one row, so every family's lone decode row takes the faster kernel.

**Row invariance** (the default, docs/determinism.md): a row's product must not depend on how many
rows the step multiplies. Measured with oneDNN 3.12 on an AMD EPYC (avx512_bf16), 1 and 2 threads:
every row count from 2 to 512 computes each row bit for bit alike, but a lone row takes another
kernel once the reduction is longer than 1024 (SmolLM2's down projection, K = 1536: about one
output row in ten differs in bfloat16); in float32 those weights also give rows of an even and an
odd position in the batch different sums. The padding above keeps a lone row off its own kernel,
and in float32 a weight with K > 1024 is held as slices of 1024 inputs whose products are added in
order. `row_invariant_formulation` picks, per weight shape at start-up, the first form (padded to
four rows, as is, sliced) that gives random rows the same bits for row counts 1 to 64, the padded
count among them.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.base import DirectCall
from opentgi.models.layers.measured_forms import MeasuredForms

log = logging.getLogger(__name__)

_PACK_ROWS = 16  # oneDNN's hint for the expected row count; measured not to matter for speed
_MIN_ROWS = 4  # fewer rows are multiplied as this many: faster, and a lone row's own kernel avoided
_K_SLICE = 1024  # float32: reductions longer than this are cut into slices added in order
_PROBE_ROW_COUNTS = (1, 2, 3, 4, 5, 7, 16, 17, 64)  # row counts a probe compares
_formulation_cache = MeasuredForms()  # per shape; kept between starts once attached (measured_forms.py)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS)


class OneDNNLinear(DirectCall, nn.Module):
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
        # the last row repeated, by one cat of whole rows (an expanded or `repeat`ed copy: 15-20 us
        # more a call, measured; this path ~4 us)
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
        docstring); `weight` is the dense weight this linear packed. Returns the form's name, or
        None where no form was measured invariant (the padded one stays)."""
        # the padded row count is part of the key: a form measured with another one is measured again
        key = (self.out_features, self.in_features, weight.dtype, self.bias is not None, _MIN_ROWS)
        if key not in _formulation_cache:
            _formulation_cache[key] = row_invariant_formulation(*key[:3])
        form = _formulation_cache[key]
        self.min_rows = 1 if form == "plain" else _MIN_ROWS
        if form == "k-slices":
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


def row_invariant_formulation(out_features: int, in_features: int, dtype: torch.dtype) -> str | None:
    """"padded" (fewer than `_MIN_ROWS` rows multiplied as that many), "plain" (every row count as
    it is) or "k-slices" (float32, padded, the reduction cut into slices of 1024 added in order):
    the first measured to give every row the same bits for row counts 1 to 64 on random data of
    this shape; None if none does (the padded form stays: the faster one)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).to(dtype)
    # bfloat16 outputs round most differences away: enough rows that some 2**16 outputs are compared
    rows = min(256, max(max(_PROBE_ROW_COUNTS), (1 << 16) // out_features))
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    probe = OneDNNLinear(weight)
    with torch.inference_mode():
        if _rows_alike(probe, x):
            return "padded"
        probe.min_rows = 1
        if _rows_alike(probe, x):
            return "plain"
        probe.min_rows = _MIN_ROWS
        if dtype == torch.float32 and in_features > _K_SLICE:
            probe.k_slices, probe.packed = _k_slices(weight), None
            if _rows_alike(probe, x):
                return "k-slices"
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
    except Exception:  # noqa: BLE001 - an old or odd build: the plain matmul serves
        log.warning("oneDNN linear unavailable; using torch's default matmul", exc_info=True)
        return False


_TILES = (64, 16, 4, 1)


class RowTiledLinear(DirectCall, nn.Module):
    """Row invariance where oneDNN's packed linear is not usable (a CPU without a oneDNN kernel
    for the dtype): `F.linear` on at most `tile` rows a call, a lone row multiplied as two (as
    OneDNNLinear), `tile` the largest of 64, 16, 4 and 1 measured at start-up to give every row
    the same bits for every row count (torch's own CPU kernels change blocking with the size)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        key = ("tiled", *weight.shape, weight.dtype, weight.device.type)
        if key not in _formulation_cache:
            _formulation_cache[key] = _invariant_tile(weight.shape[0], weight.shape[1], weight.dtype)
        self.tile = _formulation_cache[key]

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
