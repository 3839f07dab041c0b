"""Random GGUF blocks to multiply, and activation rows to multiply them with."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from opentgi.kernels import native

# byte offsets of each block's float16 fields
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,),
              Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q5_K: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
              Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}
TYPES = tuple(Q(t) for t in native.BLOCK_TYPES)


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks [n, bytes per row] with finite float16 scales of either sign."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    if qtype == Q.Q8_0:  # ggml never writes -128 (values are rounded from +-127 steps)
        values = raw[..., 2:].view(np.int8)
        values[values == -128] = -127
    for start in F16_FIELDS[qtype]:
        scales = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        raw[..., start:start + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activation rows with a spread of magnitudes across and within rows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(4).exp()
