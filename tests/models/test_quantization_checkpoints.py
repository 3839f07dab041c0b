"""AWQ and GPTQ 4-bit checkpoints (models/quantization/awq_gptq.py) and `--quantize int8 / int4`
(round to nearest at load time): a tiny Llama packed by hand in each layout loads into the int4
path and gives the logits of a float model holding the same (dequantized) weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from opentgi.config import Settings
from opentgi.models.layers.linear import OneDNNLinear
from opentgi.models.loader import ModelLoadError, load_model
from opentgi.models.quantization.linear import QuantizedLinear
from tests.helpers import tiny_models
from tests.helpers.cpu_kernels import int4_projections, int4_weights_stack
from tests.helpers.packed_checkpoints import write_packed
from tests.helpers.paged import PagedRunner

torch.set_num_threads(1)
PROMPT = [1, 504, 3458, 282, 4649, 314, 2, 45, 9001, 77]


def assert_same_weights(got, want, int4: bool = True):
    """Quantized layers (`got`) against the float model holding their dequantized weights (`want`).
    On CPU float32 rows go through the int4 kernel as bfloat16 (models/quantization/int4.py,
    kernel_dtype): the activations' rounding is all that differs there, never a weight."""
    if not int4:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.9999
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)


def logits_of(path, **settings):
    loaded = load_model(Settings(model_id=str(path), dtype="float32", **settings))
    return loaded, loaded.model.compute_logits(PagedRunner(loaded.model).step({0: PROMPT}))[0]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_packed_checkpoint_serves_its_weights_through_the_int4_path(tmp_path, method):
    packed, reference = write_packed(tmp_path, method)
    loaded, got = logits_of(packed)
    layer = loaded.model.model.layers[0]
    # one stacked int4 weight where torch's layout on this CPU stacks (int4_weights_stack), else two
    gate_up = int4_projections(layer.mlp.gate_up_proj)
    assert len(gate_up) == (1 if int4_weights_stack() else 2) and all(isinstance(p, QuantizedLinear) for p in gate_up)
    assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
    assert "int4 (groups of 32)" in loaded.model.resident
    _, want = logits_of(reference)
    assert_same_weights(got, want)
    # the flag naming the checkpoint's method is accepted
    _, flagged = logits_of(packed, quantize=method)
    assert torch.equal(flagged, got)


def test_packed_checkpoints_that_cannot_be_served_are_refused_by_name(tmp_path):
    act_order, _ = write_packed(tmp_path / "a", "gptq", {"desc_act": True})
    with pytest.raises(ModelLoadError, match="desc_act"):
        load_model(Settings(model_id=str(act_order), dtype="float32"))
    eight_bit, _ = write_packed(tmp_path / "b", "gptq", {"bits": 8})
    with pytest.raises(ModelLoadError, match="8 bits"):
        load_model(Settings(model_id=str(eight_bit), dtype="float32"))
    with pytest.raises(ModelLoadError, match="--quantize awq needs an AWQ checkpoint"):
        load_model(Settings(model_id=str(tiny_models.tiny_llama_path()), quantize="awq"))
    with pytest.raises(ModelLoadError, match="already quantized"):
        load_model(Settings(model_id=str(eight_bit), quantize="int8"))
    with pytest.raises(ModelLoadError, match="--quantize bitsandbytes is not supported"):
        load_model(Settings(model_id=str(tiny_models.tiny_llama_path()), quantize="bitsandbytes"))
    with pytest.raises(ModelLoadError, match="fp8 needs a GPU"):
        load_model(Settings(model_id=str(tiny_models.tiny_llama_path()), quantize="fp8"))


@pytest.mark.parametrize("quantize", ["int8", "int4", "int4-g64"])
def test_quantize_at_load_is_round_to_nearest(tmp_path, quantize):
    """--quantize int8 / int4: every layer projection held quantized; the logits are those of the
    float model with the round-to-nearest weights, and close to the float model's own."""
    from opentgi.models.checkpoints.loading import quantize_at_load
    from opentgi.models.quantization.methods import parse_quantize

    base = tiny_models.tiny_llama_path()
    loaded, got = logits_of(base, quantize=quantize)
    kinds = {m.weight_format.kind for m in loaded.model.modules() if isinstance(m, QuantizedLinear)}
    dense = (torch.nn.Linear, OneDNNLinear)
    # int4 layers may also hold a dense copy for prompt rows (models/quantization/prompt_copy.py)
    copies = {id(m.prompt_linear) for m in loaded.model.modules() if isinstance(m, QuantizedLinear)}
    assert kinds == {quantize[:4]} and not any(isinstance(m, dense) and id(m) not in copies
                                               for m in loaded.model.model.layers.modules())
    reference = tmp_path / "rtn"
    shutil.copytree(base, reference, ignore=shutil.ignore_patterns("*.safetensors", ".complete"))
    state = load_file(base / "model.safetensors")
    method = parse_quantize(quantize)
    save_file({name: quantize_at_load(t, method).dequantize() if ".layers." in name and name.endswith("_proj.weight")
               else t for name, t in state.items()}, reference / "model.safetensors")
    _, want = logits_of(reference)
    assert_same_weights(got, want, int4=quantize.startswith("int4"))
    _, unquantized = logits_of(base)
    assert torch.nn.functional.cosine_similarity(got, unquantized, dim=0) > 0.95  # random weights, 4 bits
