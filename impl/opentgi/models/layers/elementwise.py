"""Elementwise functions (activations, soft-caps) whose bits do not depend on the rows beside a row.

torch's vectorized CPU loops do the last values of a run that do not fill a step of two vectors
in scalar code, and a transcendental function (`exp` inside silu, gelu's tanh, sigmoid) gives other
bits there than in the vector code. Past `ELEMENTWISE_GRAIN` values an op's range is also cut into
one share a thread (`at::parallel_for`: k = min(threads, ceil(n / grain)) shares of ceil(n / k)
values; gelu's kernel: one share a thread past 16,384 values), each its own run. So where a run
ends, and with it which of a row's values go through the scalar code, follows the rows beside it
(tests/models/test_elementwise.py shows rows that differ without the padding below).

`elementwise_on_padded_copy(x, op)` applies an in-place `op` on a contiguous copy of x padded to a
length (`vector_aligned_length`) that every thread's share divides into whole steps, so that every
value goes through the vector code. The copy costs one pass over x's values; `ACTIVATIONS` skip it
where `needs_no_padding` (x runs in one share and each of its rows is whole steps, as a decode
step's gate rows are).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from opentgi.kernels import native

VECTOR_RUN = 128  # values: a multiple of any CPU loop's step of two vectors (AVX-512 bfloat16: 64)
ELEMENTWISE_GRAIN = 32768  # torch's `at::internal::GRAIN_SIZE`: elementwise ops split their range past it
ONE_SHARE = 16384  # values that every elementwise op here runs in one share (gelu's threshold)


def vector_aligned_length(n: int, threads: int | None = None) -> int:
    """The least length >= n of a contiguous run that torch cuts, on `threads` threads (torch's
    count by default), into shares of whole VECTOR_RUN steps: most ops cut a run of `length`
    values in min(threads, ceil(length / ELEMENTWISE_GRAIN)) shares, gelu's in `threads` shares
    past 16,384 values (its grain is length // threads); shares of ceil(length / shares) values."""
    threads = torch.get_num_threads() if threads is None else threads
    length = -(-n // VECTOR_RUN) * VECTOR_RUN
    while True:
        shares = 1 if length < ELEMENTWISE_GRAIN or threads == 1 else min(threads, -(-length // ELEMENTWISE_GRAIN))
        step = VECTOR_RUN * math.lcm(shares, threads)
        padded = -(-length // step) * step
        if padded == length:
            return length
        length = padded


def elementwise_on_padded_copy(x: torch.Tensor, op: Callable[[torch.Tensor], object],
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """`op` (an in-place elementwise function) applied to a contiguous copy of x (in `dtype`, x's by
    default) padded to `vector_aligned_length`: every value goes through the vector code (module
    docstring). Returns the copy, x's shape."""
    n = x.numel()
    length = vector_aligned_length(n) if x.device.type == "cpu" else n  # CUDA kernels have no scalar tail
    flat = torch.empty(length, dtype=dtype or x.dtype, device=x.device)
    out = flat[:n].view(x.shape)
    out.copy_(x)
    flat[n:].zero_()
    op(flat)
    return out


def needs_no_padding(x: torch.Tensor) -> bool:
    """Whether an elementwise op over x runs in one share (gelu's cut starts past ONE_SHARE) whose
    rows are whole steps each."""
    return x.numel() <= ONE_SHARE and x.dim() > 0 and x.stride(-1) == 1 and x.shape[-1] % VECTOR_RUN == 0


def _activation(fn: Callable[[torch.Tensor], torch.Tensor],
                fn_: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(x) as a new tensor: `fn` itself where x runs in one share of whole rows (a decode step's
    gate rows) or on CUDA, else `fn_` (in place) over a padded copy."""
    def act(x: torch.Tensor) -> torch.Tensor:
        return fn(x) if x.device.type != "cpu" or needs_no_padding(x) else elementwise_on_padded_copy(x, fn_)
    return act


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _activation(F.silu, partial(F.silu, inplace=True)),
    "swish": _activation(F.silu, partial(F.silu, inplace=True)),
    "gelu": _activation(F.gelu, torch.ops.aten.gelu_),
    "gelu_pytorch_tanh": _activation(partial(F.gelu, approximate="tanh"),
                                     partial(torch.ops.aten.gelu_, approximate="tanh")),
}

# the activations the native act-and-multiply ops compute: name -> the op's act id (csrc/op_helpers.h)
NATIVE_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}


def act_and_mul(gate_up: torch.Tensor, intermediate: int, act: str, use_native: bool = False) -> torch.Tensor:
    """act(gate) * up, gate and up the halves of gate_up's last dim (a gated MLP's one matmul). With
    `use_native` and silu or gelu_pytorch_tanh on CPU in float32/bfloat16: one native op
    (`opentgi::silu_mul`, `opentgi::gelu_tanh_mul`: every value through the same vector code, so no
    padding is needed for a row's bits to be its own); else `ACTIVATIONS[act](gate).mul_(up)`."""
    if (use_native and act in NATIVE_ACTIVATIONS and gate_up.device.type == "cpu"
            and gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.shape[-1] == 2 * intermediate):
        return native.gelu_tanh_mul(gate_up) if NATIVE_ACTIVATIONS[act] else native.silu_mul(gate_up)
    gate, up = gate_up.split(intermediate, dim=-1)
    return ACTIVATIONS[act](gate).mul_(up)
