"""One tensor-parallel rank's part of a GGUF tensor (models/parallel.py ShardPlan.slice), read
from the memory-mapped file and dequantized to float32 from only the blocks it covers.

A GGUF stores a 2-D tensor as rows of blocks along its contiguous (input) dimension, so:
- a slice of output rows (column-parallel q/k/v, gate/up, the vocabulary's rows of the embedding
  and LM head) is those rows' blocks, exactly (a permuted q/k picks its rows through the order
  that undoes llama.cpp's permutation);
- a slice of input columns (row-parallel o/down) whose bounds fall on block boundaries is those
  blocks of every row; bounds inside a block (e.g. a 128-column half of a Q4_K row of 256) are
  dequantized from whole rows, a chunk of rows at a time (ggml.DENSE_CHUNK_BYTES), then cut.
The rank holds its slices dense in the serving dtype, as a rank of a folder checkpoint does.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from opentgi.models.quantization import ggml


def read_slice(tensor, shape: tuple[int, ...], order: torch.Tensor | None, index) -> torch.Tensor:
    """`tensor` (a gguf_header.GGUFTensor, Hugging Face `shape`) at `index`: a slice of rows, or
    (slice(None), a slice of columns); `order`: the file's row of each model row, or None."""
    qtype, data = tensor.tensor_type, tensor.data
    if len(shape) == 1:
        return ggml.dense(data, qtype, shape)[index]
    rows, columns = index if isinstance(index, tuple) else (index, slice(None))
    if order is None and isinstance(rows, slice):
        part = data[rows]  # a view of the map: only these rows' pages are read
    else:
        picked = torch.arange(shape[0])[rows] if order is None else order[rows]
        part = data[picked.numpy()]
    n, k = part.shape[0], shape[1]
    lo, hi, step = columns.indices(k)
    if step != 1:
        raise ValueError(f"{tensor.name}: a strided column slice is not read")
    if (lo, hi) == (0, k):
        return ggml.dense(part, qtype, (n, k))
    block, type_size = GGML_QUANT_SIZES[qtype]
    if data.dtype != np.uint8:  # F32 / F16: values, not blocks
        return ggml.dense(np.ascontiguousarray(part[:, lo:hi]), qtype, (n, hi - lo))
    if lo % block == 0 and hi % block == 0:
        blocks = np.ascontiguousarray(part[:, lo // block * type_size:hi // block * type_size])
        return ggml.dense(blocks, qtype, (n, hi - lo))
    out = torch.empty(n, hi - lo)
    chunk = max(1, ggml.DENSE_CHUNK_BYTES // (4 * k))
    for start in range(0, n, chunk):
        rows_part = part[start:start + chunk]
        out[start:start + rows_part.shape[0]] = ggml.dense(rows_part, qtype, (rows_part.shape[0], k))[:, lo:hi]
    return out
