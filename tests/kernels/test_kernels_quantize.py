"""`--quantize int8|int4`, AWQ and GPTQ on the native kernels (models/quantization/native_layouts.py):
the blocks hold the values gguf-py's reference dequantizes, a model's projections are held as
Q8_0 / Q4_1 blocks, the model computes what the float model with the same weights does (up to the
activations' 8-bit rounding), and a sequence's logits are the same bits alone or in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from opentgi.config import Settings
from opentgi.models.loader import load_model
from opentgi.models.quantization import native_layouts, rtn
from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight
from opentgi.models.quantization.linear import QuantizedLinear
from tests.helpers import tiny_models
from tests.helpers.packed_checkpoints import write_packed
from tests.helpers.paged import PagedRunner

torch.set_num_threads(1)
PROMPT = [1, 504, 3458, 282, 4649, 314, 2, 45, 9001, 77]


def reference(blocks: native_layouts.NativeBlocks) -> torch.Tensor:
    qtype = GGMLQuantizationType(blocks.qtype)
    return torch.from_numpy(dequantize(blocks.blocks.numpy(), qtype).astype(np.float32)).view(blocks.shape)


def test_q8_0_rounds_each_block_against_its_float16_scale():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(0))
    w[3, 32:64] = 0  # an all-zero block: scale 0, values 0
    blocks = native_layouts.q8_0_blocks(w)
    assert blocks.blocks.shape == (24, 3 * 34) and blocks.qtype == 8
    got = reference(blocks)
    d = (w.view(24, 3, 32).abs().amax(-1) / 127).half().float()
    assert torch.all((got - w).abs().view(24, 3, 32) <= d[..., None] / 2 + 1e-7)  # round to nearest
    assert torch.equal(got[3, 32:64], torch.zeros(32))


@pytest.mark.parametrize("group_size", [32, 128])
def test_q4_1_holds_the_int4_groups_values(group_size):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    groups = rtn.int4_groups(w, group_size)
    blocks = native_layouts.q4_1_blocks(groups)
    assert blocks.blocks.shape == (16, 8 * 20) and blocks.qtype == 3
    # the same values but for the float16 rounding of each block's scale and minimum
    torch.testing.assert_close(reference(blocks), groups.dequantize(), atol=3e-3, rtol=0)


def logits_of(path, **settings):
    loaded = load_model(Settings(model_id=str(path), dtype="float32", **settings))
    return loaded, loaded.model.compute_logits(PagedRunner(loaded.model).step({0: PROMPT}))[0]


def block_types(loaded) -> set[str]:
    formats = [m.weight_format for m in loaded.model.model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert formats and all(isinstance(f, GGUFBlockWeight) for f in formats)
    return {f.description.split()[0] for f in formats}


@pytest.mark.parametrize(("quantize", "qtype"), [("int8", "Q8_0"), ("int4", "Q4_1"), ("int4-g64", "Q4_1")])
def test_quantize_at_load_serves_native_blocks(kernels, quantize, qtype):
    base = tiny_models.tiny_llama_path()
    loaded, got = logits_of(base, quantize=quantize, kernels="native")
    assert block_types(loaded) == {qtype} and loaded.kernels.startswith("native (")
    _, torch_path = logits_of(base, quantize=quantize, kernels="torch")
    _, unquantized = logits_of(base)
    # int8: finer scales than the torch path's one per channel; int4: the same values
    assert torch.nn.functional.cosine_similarity(got, torch_path, dim=0) > (0.999 if qtype == "Q4_1" else 0.99)
    assert torch.nn.functional.cosine_similarity(got, unquantized, dim=0) > (0.95 if qtype == "Q4_1" else 0.999)


def test_a_quantized_gguf_requantized_at_load_serves_native_blocks(kernels):
    """--quantize int8 on a GGUF: each projection dequantized from its blocks, then held as Q8_0."""
    loaded, got = logits_of(tiny_models.tiny_gguf_path(), quantize="int8", kernels="native")
    assert block_types(loaded) == {"Q8_0"}
    _, own_blocks = logits_of(tiny_models.tiny_gguf_path(), kernels="native")
    assert torch.nn.functional.cosine_similarity(got, own_blocks, dim=0) > 0.99


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_packed_checkpoints_serve_their_values_as_q4_1(kernels, tmp_path, method):
    packed, dense = write_packed(tmp_path, method)
    loaded, got = logits_of(packed, kernels="native")
    assert block_types(loaded) == {"Q4_1"}
    _, want = logits_of(dense)
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999


def test_a_sequence_gets_the_same_logits_alone_or_in_a_batch(kernels):
    loaded = load_model(Settings(model_id=str(tiny_models.tiny_llama_path()), dtype="float32",
                                 quantize="int8", kernels="native"))
    model = loaded.model
    prompts = [PROMPT, [5, 6, 7, 8, 9], list(range(100, 117))]
    alone, together = PagedRunner(model), PagedRunner(model)
    first = model.compute_logits(alone.step({0: prompts[0]}))
    batch = model.compute_logits(together.step({i: p for i, p in enumerate(prompts)}))
    assert torch.equal(first[0], batch[0])
    for token in (7, 11):  # decode steps: one row alone, three rows together
        first = model.compute_logits(alone.step({0: [token]}))
        batch = model.compute_logits(together.step({0: [token], 1: [token], 2: [token]}))
        assert torch.equal(first[0], batch[0])
