"""AWQ and GPTQ 4-bit checkpoints onto the int4 path.

Both store, per linear, `qweight` and `qzeros` (int32, eight 4-bit values each), fp16 `scales`
[K / group, N] and compute `w = (q - z) * s`. They differ in what is packed along which axis:

- GPTQ (AutoGPTQ, `checkpoint_format` "gptq"): qweight [K / 8, N] packs 8 inputs, value j in bits
  4j..4j+3; qzeros [K / group, N / 8] packs 8 outputs and stores z - 1 ("gptq_v2" stores z);
  `g_idx` [K] gives each input's group. With `desc_act` the groups are not contiguous runs of
  inputs; such a checkpoint is refused by name (the kernels take contiguous groups).
- AWQ (AutoAWQ, version "gemm"): qweight [K, N / 8] and qzeros [K / group, N / 8] pack 8 outputs
  in the order 0, 2, 4, 6, 1, 3, 5, 7.

`q - z` becomes `(k - 8) * s + zero` with `zero = (8 - z) * s`: exact in float32. Groups larger
than the kernels take (or `group_size` -1, one group per row) are split into groups of 256 with
the same scale and zero.
"""

from __future__ import annotations

import torch

from opentgi.models.quantization.int4 import GROUP_SIZES, Int4Groups

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # packed nibble j holds output 8i + AWQ_PACK_ORDER[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class PackedCheckpointError(ValueError):
    """An AWQ/GPTQ checkpoint this server cannot serve; the message says why."""


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> int [..., C, 8]: nibble j of each word."""
    return (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF


def check_config(qconfig: dict) -> tuple[str, int]:
    """(method, group size) of a checkpoint's `quantization_config`, or a clear refusal."""
    method = str(qconfig.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise PackedCheckpointError(f"quantization method {method!r} in config.json is not served "
                                    f"(awq and gptq 4-bit are)")
    bits = int(qconfig.get("bits", qconfig.get("w_bit", 4)))
    if bits != 4:
        raise PackedCheckpointError(f"{method} with {bits} bits: only 4-bit checkpoints are served")
    if method == "awq" and str(qconfig.get("version", "gemm")).lower() != "gemm":
        raise PackedCheckpointError(f"AWQ version {qconfig.get('version')!r}: only the GEMM layout is served")
    if method == "gptq" and qconfig.get("desc_act"):
        raise PackedCheckpointError("GPTQ with desc_act (act-order, inputs reordered by g_idx) is not "
                                    "served: the int4 kernels take contiguous groups")
    group = int(qconfig.get("group_size", qconfig.get("q_group_size", 128)))
    return method, group


def gptq_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                g_idx: torch.Tensor | None = None, zero_offset: int = 1) -> Int4Groups:
    k8, n = qweight.shape
    k = k8 * 8
    group_size = k if group_size == -1 else group_size
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        raise PackedCheckpointError("GPTQ g_idx reorders the inputs (act-order): not served")
    q = _unpack(qweight).permute(0, 2, 1).reshape(k, n)  # [K, N]
    z = _unpack(qzeros).reshape(qzeros.shape[0], n) + zero_offset  # [K / group, N]
    return _groups(q.T, z.T, scales.T, group_size)


def awq_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Groups:
    k = qweight.shape[0]
    group_size = k if group_size == -1 else group_size
    order = torch.tensor(AWQ_PACK_ORDER)

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [R, N / 8] -> [R, N], outputs in order
        nibbles = _unpack(packed)
        out = torch.empty_like(nibbles)
        out[..., order] = nibbles
        return out.reshape(packed.shape[0], -1)

    return _groups(unpack(qweight).T, unpack(qzeros).T, scales.T, group_size)


def _groups(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group_size: int) -> Int4Groups:
    """q [N, K] values, z and s [N, K / group]: `w = (q - z) * s` as Int4Groups."""
    n, k = q.shape
    s = s.float()
    zero = (8 - z.float()) * s
    size = group_size
    if size not in GROUP_SIZES:
        size = next((g for g in reversed(GROUP_SIZES) if group_size % g == 0), None)
        if size is None:
            raise PackedCheckpointError(f"group size {group_size} is not a multiple of 32")
        s = s.repeat_interleave(group_size // size, dim=1)
        zero = zero.repeat_interleave(group_size // size, dim=1)
    return Int4Groups.from_values(q, s, zero, size)
