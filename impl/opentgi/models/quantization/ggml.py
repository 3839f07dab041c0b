"""GGUF (ggml) block types onto the formats torch's kernels take.

- Q4_0 (`w = d * (q - 8)`), Q4_1 (`w = d * q + m`) and Q4_K (`w = d * sc * q - dmin * m`, 6-bit
  sub-block scales and mins) are 4-bit values in groups of 32: they become `Int4Groups` with
  `scale` and `zero` computed exactly in float32 (models/quantization/int4.py). The kernels hold
  scales and zeros in the serving dtype, so in bfloat16 each is rounded to the nearest bfloat16
  (as the dense path rounds each weight).
- Every other type (Q5_K, Q6_K, Q8_0, F16, BF16, F32, ...) has no exact 4-bit form: it is
  dequantized once to float32 (Q8_0, Q5_K and Q6_K, the dense parts of most K-quant files, by
  gguf-py's steps in torch's ops, the rest by gguf-py) and served dense in the serving dtype;
  `dense_types` collects their names for the start-up line. Into its weight it is dequantized a chunk of rows
  at a time (`dense_into`, at most `DENSE_CHUNK_BYTES` of float32 at once), the same values:
  whole, a random 1B file's Q8_0 embedding held 402 MB of float32 beside its 201 MB bfloat16
  weight at start-up (the start's peak 1,388 MB against 996 MB once loaded), and an 8B Q4_K_M
  file's Q6_K output head would hold 2.1 GB.

The block layouts are ggml's (ggml-common.h); tests/models/test_quantization_ggml.py checks every mapped
type against gguf-py's `dequantize` on random blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from opentgi.models.quantization.int4 import Int4Groups

INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
_QK_K = 256
DENSE_CHUNK_BYTES = 16 << 20  # float32 values a dense tensor is dequantized in when copied into its weight


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 field at byte `start` (even) of every block, as float32 [rows, blocks]: the
    blocks read as float16 words (block sizes and offsets are even), one word picked, no copy."""
    if blocks.shape[-1] % 2 == 0 and blocks.ctypes.data % 2 == 0 and blocks.flags.c_contiguous:
        words = blocks.view(np.float16)
        return torch.from_numpy(words[..., start // 2].astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]).float()


def int4_groups(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Int4Groups:
    """`raw`: the tensor's blocks as uint8 [N, bytes per row] (a view of the file); shape (N, K)."""
    n, k = shape
    if qtype in (Q.Q4_0, Q.Q4_1):
        size = 18 if qtype == Q.Q4_0 else 20
        blocks = raw.reshape(n, k // 32, size)
        d = _f16(blocks, 0)
        if qtype == Q.Q4_0:
            zero = torch.zeros_like(d)  # (q - 8) * d
        else:
            zero = _f16(blocks, 2) + 8 * d  # q * d + m == (q - 8) * d + (m + 8 d)
        qs = blocks[..., size - 16:]  # values 0..15 in the low nibbles, 16..31 in the high ones
        values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return Int4Groups(torch.from_numpy(values.reshape(n, k)), d, zero, 32)
    if qtype == Q.Q4_K:
        blocks = raw.reshape(n, k // _QK_K, 144)
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _q4k_scales_mins(torch.from_numpy(np.ascontiguousarray(blocks[..., 4:16])))
        scale = d[..., None] * sc.float()  # [N, K/256, 8]
        zero = 8 * scale - dmin[..., None] * mn.float()
        # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
        qs = blocks[..., 16:].reshape(n, k // _QK_K, 4, 1, 32)
        values = np.concatenate([qs & 0x0F, qs >> 4], axis=3)
        return Int4Groups(torch.from_numpy(values.reshape(n, k)), scale.reshape(n, k // 32).contiguous(),
                          zero.reshape(n, k // 32).contiguous(), 32)
    raise ValueError(f"{qtype.name} has no 4-bit form")


def _q4k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed into 12 bytes (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q6k(blocks: np.ndarray) -> torch.Tensor:
    """Q6_K blocks [n, 210] -> float32 [n, 256]: gguf-py's steps in torch's ops (the same numbers,
    faster than its numpy). Per block: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8
    sub-block scales, the float16 d; w = (d * scale) * (q - 32)."""
    n = blocks.shape[0]
    raw = torch.from_numpy(np.array(blocks[:, :208]))  # a writable copy (the file is mapped read-only)
    d = _f16(blocks, 208)[:, None] * raw[:, 192:208].view(torch.int8).float()  # [n, 16]
    ql = raw[:, :128].reshape(n, 2, 1, 64).bitwise_right_shift(_SHIFTS_4).bitwise_and_(0x0F).reshape(n, 8, 32)
    qh = raw[:, 128:192].reshape(n, 2, 1, 32).bitwise_right_shift(_SHIFTS_2).bitwise_and_(0x03).reshape(n, 8, 32)
    q = ql.bitwise_or_(qh.bitwise_left_shift_(4)).view(torch.int8).sub_(32).reshape(n, 16, 16).float()
    return q.mul_(d[:, :, None]).reshape(n, 256)


def _q5k(blocks: np.ndarray) -> torch.Tensor:
    """Q5_K blocks [n, 176] -> float32 [n, 256], gguf-py's steps in torch's ops (as `_q6k`): float16
    d and dmin, 12 bytes of 6-bit sub-block scales and mins (as Q4_K's), 32 bytes of fifth bits, 128
    of low nibbles; w = (d * scale) * q - dmin * min."""
    n = blocks.shape[0]
    raw = torch.from_numpy(np.array(blocks[:, 4:]))  # a writable copy (the file is mapped read-only)
    sc, mn = _q4k_scales_mins(raw[:, :12])
    d = (_f16(blocks, 0)[:, None] * sc.float()).reshape(n, 8, 1)
    dm = (_f16(blocks, 2)[:, None] * mn.float()).reshape(n, 8, 1)
    qh = raw[:, 12:44].reshape(n, 1, 1, 32).bitwise_right_shift(_SHIFTS_1).bitwise_and_(0x01).reshape(n, 8, 32)
    ql = raw[:, 44:].reshape(n, 4, 1, 32).bitwise_right_shift(_SHIFTS_4).bitwise_and_(0x0F).reshape(n, 8, 32)
    q = ql.bitwise_or_(qh.bitwise_left_shift_(4)).float()
    return q.mul_(d).sub_(dm).reshape(n, 256)


_SHIFTS_4 = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
_SHIFTS_2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
_SHIFTS_1 = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)


def dense(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor as float32 (block types: Q8_0, Q5_K and Q6_K here, the rest by gguf-py)."""
    if qtype == Q.F32:
        return torch.from_numpy(np.array(raw, dtype=np.float32)).reshape(shape)
    if qtype == Q.F16:
        return torch.from_numpy(np.array(raw).view(np.float16)).float().reshape(shape)
    if qtype == Q.BF16:
        return torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16).float().reshape(shape)
    if qtype == Q.Q8_0:  # d * q, as gguf-py computes it, without its per-chunk Python loop
        blocks = raw.reshape(-1, 34)
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).view(np.int8))
        return q.float().mul_(_f16(blocks, 0)[:, None]).reshape(shape)  # in place: one float32 copy
    if qtype == Q.Q6_K:
        return _q6k(np.asarray(raw).reshape(-1, 210)).reshape(shape)
    if qtype == Q.Q5_K:
        return _q5k(np.asarray(raw).reshape(-1, 176)).reshape(shape)
    return torch.from_numpy(dequantize(np.asarray(raw), qtype)).reshape(shape)


def dense_into(dest: torch.Tensor, raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> None:
    """Copy the tensor into `dest` (`shape`, any dtype) as `dest.copy_(dense(...))` would, a chunk
    of rows at a time: no float32 copy of the whole tensor (module docstring)."""
    if len(shape) < 2:
        dest.copy_(dense(raw, qtype, shape))
        return
    rows, row_values = shape[0], int(np.prod(shape[1:]))
    step = max(1, DENSE_CHUNK_BYTES // (4 * row_values))
    by_row = raw.reshape(rows, -1)  # a row's values (F32, F16, BF16) or its blocks' bytes
    for start in range(0, rows, step):
        part = by_row[start:start + step]
        dest[start:start + part.shape[0]].copy_(dense(part, qtype, (part.shape[0], *shape[1:])))
