"""GGUF block types onto torch's formats (models/quantization/ggml.py): every 4-bit type decodes to
exactly what gguf-py's `dequantize` gives on random blocks, and the int4 kernel multiplies by it;
other types come back dense, equal to gguf-py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from opentgi.models.quantization import ggml
from opentgi.models.quantization.int4 import Int4Weight

torch.set_num_threads(1)

# byte offsets of each block's float16 fields (random bytes there could be inf or NaN)
_F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks [n, bytes per row] with finite, modest float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for start in _F16_FIELDS[qtype]:
        scales = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        raw[..., start:start + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", ggml.INT4_TYPES, ids=lambda q: q.name)
def test_int4_types_decode_exactly_as_gguf_py(qtype):
    n, k = 6, 512
    raw = random_blocks(qtype, n, k)
    expected = torch.from_numpy(dequantize(raw, qtype)).reshape(n, k)
    groups = ggml.int4_groups(raw, qtype, (n, k))
    assert groups.shape == (n, k) and groups.group_size == 32
    torch.testing.assert_close(groups.dequantize(), expected, rtol=0, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("qtype", ggml.INT4_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_multiplies_by_the_gguf_weights(qtype, dtype):
    n, k = 64, 256
    raw = random_blocks(qtype, n, k, seed=1)
    weight = torch.from_numpy(dequantize(raw, qtype)).reshape(n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    got = Int4Weight(ggml.int4_groups(raw, qtype, (n, k)), dtype, torch.device("cpu")).matmul(x.to(dtype)).float()
    expected = x @ weight.T
    tol = 3e-2  # float32 too: its rows go through the kernel as bfloat16 (int4.kernel_dtype)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * float(expected.abs().max()))


def test_a_float32_host_runs_the_int4_kernel_in_bfloat16():
    """The cliff of a CPU without native bfloat16 (float32 serving): torch's int4 kernel is many
    times slower with float32 activations than with bfloat16 ones, so float32 int4 layers must
    hold bfloat16 scales and convert their rows, returning float32."""
    n, k = 64, 256
    raw = random_blocks(Q.Q4_1, n, k, seed=2)
    weight = Int4Weight(ggml.int4_groups(raw, Q.Q4_1, (n, k)), torch.float32, torch.device("cpu"))
    assert weight.activation_dtype == torch.bfloat16 and weight.scales_and_zeros.dtype == torch.bfloat16
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = weight.matmul(x)
        alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(3)])
    assert got.dtype == torch.float32 and torch.equal(got, alone)


@pytest.mark.parametrize("n,k", [(3, 256), (5, 768)])
@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_other_types_come_back_dense(qtype, n, k):
    """Q8_0, Q5_K and Q6_K by torch's ops of our own (several blocks a row: 768 values), the rest by gguf-py."""
    raw = random_blocks(qtype, n, k)
    with pytest.raises(ValueError, match="no 4-bit form"):
        ggml.int4_groups(raw, qtype, (n, k))
    expected = torch.from_numpy(dequantize(raw, qtype)).reshape(n, k)
    assert torch.equal(ggml.dense(raw, qtype, (n, k)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0, Q.F16, Q.F32], ids=lambda q: q.name)
def test_a_dense_tensor_goes_into_its_weight_in_chunks_with_the_same_values(qtype, dtype, monkeypatch):
    """`dense_into` dequantizes 3 rows at a time here (a last chunk of 1): the weight gets exactly
    what the whole tensor converted at once gives."""
    n, k = 7, 256
    if qtype == Q.F32:
        raw = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32)
    elif qtype == Q.F16:
        raw = np.random.default_rng(1).standard_normal((n, k)).astype(np.float16)
    else:
        raw = random_blocks(qtype, n, k, seed=1)
    monkeypatch.setattr(ggml, "DENSE_CHUNK_BYTES", 3 * 4 * k)
    calls = []
    whole = ggml.dense
    monkeypatch.setattr(ggml, "dense", lambda part, *a: calls.append(len(part)) or whole(part, *a))
    dest = torch.empty(n, k, dtype=dtype)
    ggml.dense_into(dest, raw, qtype, (n, k))
    assert calls == [3, 3, 1]
    assert torch.equal(dest, whole(raw, qtype, (n, k)).to(dtype))


def test_float_types_come_back_as_stored():
    values = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert torch.equal(ggml.dense(values, Q.F32, (4, 8)), torch.from_numpy(values))
    half = values.astype(np.float16)
    assert torch.equal(ggml.dense(half.view(np.uint8), Q.F16, (4, 8)), torch.from_numpy(half).float())
