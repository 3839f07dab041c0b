"""Dense copies of int4 weights for prompt rows.

torch's CPU int4 kernel computes each row alike for any row count, but its cost grows with the
rows faster than a dense matmul's: cheaper for a decode step's few rows, dearer for a prompt's many
(docs/benchmarks.md). So a row's kernel follows its kind (models/layers/row_kinds.py): generated
rows take the int4 kernel, prompt rows a dense copy of the same weight in the serving dtype,
multiplied by the row-invariant oneDNN form (models/layers/linear.py). Each kernel is row-invariant
and a token's kind never changes, so a row's numbers stay independent of its step.

The copy holds the kernel's own weights, rounded once to the serving dtype: `dequantize_int4`
unpacks the CPU layout and computes `(k - 8) * scale + zero` in float32 from the scales and zeros
as the kernel holds them, checked against the kernel itself (the weight times an identity) at
start-up. Dequantizing per step instead costs as much as many prompt rows, so the copies are kept
when all of them fit in `PROMPT_COPY_MAX_BYTES`; a larger model keeps one copy of each weight (its
resident memory: docs/benchmarks.md) and its prompt rows go through the int4 kernel.

Batch invariance keeps generated rows on the int4 kernel whatever the step's size, and that
kernel cannot be made fast for many rows without other bits (docs/determinism.md).
`--nondeterministic` (`row_invariant` False) buys that back: a step of more than
`NONDETERMINISTIC_INT4_MAX_ROWS` rows takes the dense copies for every row. With `--speculate N`
the int4 kernel keeps steps of up to N + 1 rows (`keep_int4_up_to`), so that a lone sequence's
verify step computes what decoding its tokens one per step does.
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.models.layers.linear import OneDNNLinear
from opentgi.models.quantization.int4 import Int4Weight, cpu_block_layout_matches
from opentgi.models.quantization.linear import QuantizedLinear

PROMPT_COPY_MAX_BYTES = 256 << 20
NONDETERMINISTIC_INT4_MAX_ROWS = 4  # --nondeterministic: larger steps through the dense copies


def _unpack_cpu_blocks(weight: Int4Weight) -> torch.Tensor:
    """The 4-bit values [N, K] (uint8) of torch's CPU block layout (int4.py `_pack_for_cpu_blocks`)."""
    n, k = weight.out_features, weight.in_features
    packed = weight.packed.view(n // 64, k, 1, 32)
    both = torch.cat([packed & 15, packed >> 4], dim=2)  # [N / 64, K, 2, 32]
    return both.permute(0, 2, 3, 1).reshape(n, k)


def _through_kernel(weight: Int4Weight, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's weights of the first `columns` inputs, [N, columns]: an identity through it."""
    eye = torch.eye(columns, weight.in_features, dtype=dtype)
    return weight.matmul(eye).T


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weights [N, K] the CPU int4 kernel multiplies by, rounded to `dtype`."""
    n, k, g = weight.out_features, weight.in_features, weight.group_size
    if n % 64 or not cpu_block_layout_matches():  # another layout: the kernel itself, K rows
        return _through_kernel(weight, k, dtype).contiguous()
    values = _unpack_cpu_blocks(weight).view(n, k // g, g).float()
    sz = weight.scales_and_zeros.float()  # [K / g, N, 2]
    scale = sz[..., 0].T[..., None]
    dense = values.sub_(8).mul_(scale).add_(sz[..., 1].T[..., None]).view(n, k).to(dtype)
    probe = min(k, 2 * g)
    if not torch.equal(dense[:, :probe], _through_kernel(weight, probe, dtype)):
        return _through_kernel(weight, k, dtype).contiguous()
    return dense


def _copy_bytes(linear: OneDNNLinear) -> int:
    parts = [linear.packed] if linear.packed is not None else list(linear.k_slices or ())
    return sum(p.numel() * p.element_size() for p in parts)


def add_prompt_copies(module: nn.Module, dtype: torch.dtype, row_invariant: bool,
                      max_bytes: int = PROMPT_COPY_MAX_BYTES) -> int:
    """Give every CPU int4 linear inside `module` a dense copy for prompt rows, if all the copies
    fit in `max_bytes` (else none: one copy of each weight). Without `row_invariant`
    (--nondeterministic) the copies also take every row of a step larger than
    `NONDETERMINISTIC_INT4_MAX_ROWS`. Returns the bytes held."""
    linears = [sub for sub in module.modules() if isinstance(sub, QuantizedLinear)
               and isinstance(sub.weight_format, Int4Weight) and sub.weight_format.device.type == "cpu"]
    need = sum(s.out_features * s.in_features for s in linears) * torch.finfo(dtype).bits // 8
    if need > max_bytes:
        return 0
    held = 0
    threads = torch.get_num_threads()
    for sub in linears:
        fmt = sub.weight_format
        with torch.inference_mode():
            # elementwise work on one thread: an OpenMP team waits for descheduled threads on a
            # busy machine (as single_thread_cat.py)
            torch.set_num_threads(1)
            try:
                dense = dequantize_int4(fmt, dtype)
                copy = OneDNNLinear(dense)
            finally:
                torch.set_num_threads(threads)
            if row_invariant:
                copy.make_row_invariant(dense)
        del dense
        sub.prompt_linear = copy
        sub.dense_above_rows = None if row_invariant else NONDETERMINISTIC_INT4_MAX_ROWS
        held += _copy_bytes(copy)
    return held


def keep_int4_up_to(module: nn.Module, rows: int) -> None:
    """Where the dense copies take large steps (--nondeterministic), leave steps of up to `rows`
    rows to the int4 kernel (--speculate N: a lone sequence's verify step, N + 1 rows)."""
    for sub in module.modules():
        if isinstance(sub, QuantizedLinear) and sub.dense_above_rows is not None:
            sub.dense_above_rows = max(sub.dense_above_rows, rows)
