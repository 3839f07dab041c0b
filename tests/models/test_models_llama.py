"""Paged Llama-family models against transformers' own forward of the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from opentgi.models.attention.torch_backend import TorchAttentionBackend
from opentgi.models.registry import build_paged_model
from tests.helpers import tiny_models
from tests.helpers.paged import PROMPT, PagedRunner, hf_logits, load_paged


@pytest.mark.parametrize("builder", [tiny_models.tiny_llama_path, tiny_models.tiny_qwen2_path,
                                     tiny_models.tiny_mistral_path])
def test_whole_prompt_then_chunks_and_decodes_match_transformers(builder):
    path = builder()
    model = load_paged(path)
    expected = hf_logits(path, PROMPT)

    whole = PagedRunner(model)
    hidden = whole.step({0: PROMPT})
    torch.testing.assert_close(model.compute_logits(hidden)[0], expected[-1], atol=1e-4, rtol=1e-4)

    # The same prompt as two chunks, then one token at a time; checked at every step.
    runner = PagedRunner(model)
    got = [model.compute_logits(runner.step({0: PROMPT[:13]}))[0]]
    got.append(model.compute_logits(runner.step({0: PROMPT[13:25]}))[0])
    for t in range(25, len(PROMPT)):
        got.append(model.compute_logits(runner.step({0: [PROMPT[t]]}))[0])
    want = torch.stack([expected[12], expected[24], *expected[25:]])
    torch.testing.assert_close(torch.stack(got), want, atol=1e-4, rtol=1e-4)


def test_batched_sequences_match_each_alone():
    path = tiny_models.tiny_llama_path()
    model = load_paged(path)
    prompts = {0: PROMPT[:9], 1: PROMPT[5:30], 2: PROMPT[:18]}
    expected = {s: hf_logits(path, p) for s, p in prompts.items()}
    runner = PagedRunner(model)
    first = model.compute_logits(runner.step({0: prompts[0], 1: prompts[1][:10]}))
    torch.testing.assert_close(first[0], expected[0][8], atol=1e-4, rtol=1e-4)
    # mixed step: decode of 0 (its next token), chunk of 1, whole prompt of 2
    extra = 777
    mixed = model.compute_logits(runner.step({0: [extra], 1: prompts[1][10:], 2: prompts[2]}))
    torch.testing.assert_close(mixed[0], hf_logits(path, prompts[0] + [extra])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1], expected[1][-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[2], expected[2][-1], atol=1e-4, rtol=1e-4)


def test_mistral_sliding_window_matches_transformers():
    path = tiny_models.tiny_mistral_path(sliding_window=8)
    model = load_paged(path)
    assert model.spec.sliding_window == 8
    expected = hf_logits(path, PROMPT)
    runner = PagedRunner(model)
    got = [model.compute_logits(runner.step({0: PROMPT[:20]}))[0]]
    for t in range(20, len(PROMPT)):
        got.append(model.compute_logits(runner.step({0: [PROMPT[t]]}))[0])
    torch.testing.assert_close(torch.stack(got), expected[19:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0},
])
def test_rope_scaling_matches_transformers(rope_scaling):
    path = tiny_models.tiny_llama_path(rope_scaling=rope_scaling)
    model = load_paged(path)
    hidden = PagedRunner(model).step({0: PROMPT})
    torch.testing.assert_close(model.compute_logits(hidden)[0], hf_logits(path, PROMPT)[-1],
                               atol=1e-4, rtol=1e-4)


def test_reward_score_matches_transformers():
    path = tiny_models.tiny_reward_path()
    model = load_paged(path)
    assert model.is_reward_model
    hf = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = {0: PROMPT[:12], 1: PROMPT[3:31]}
    scores = model.compute_score(PagedRunner(model).step(prompts))
    assert scores.shape == (2,) and scores.dtype == torch.float32
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, 0] for p in prompts.values()])
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(TypeError):
        model.compute_logits(torch.zeros(1, 64))


def test_unsupported_configs_go_to_the_generic_path():
    from transformers import LlamaConfig, Qwen2Config

    from opentgi.models.registry import paged_unsupported_reason

    assert paged_unsupported_reason(LlamaConfig(architectures=["LlamaForCausalLM"])) is None
    dynamic = LlamaConfig(architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in paged_unsupported_reason(dynamic)
    assert "relu" in paged_unsupported_reason(LlamaConfig(architectures=["LlamaForCausalLM"], hidden_act="relu"))
    windowed = Qwen2Config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True)
    assert paged_unsupported_reason(windowed) is None  # per-layer windows (tests/models/test_models_families.py)
    partial = Qwen2Config(architectures=["Qwen2ForCausalLM"], partial_rotary_factor=0.5)
    assert "partial_rotary_factor" in paged_unsupported_reason(partial)
    assert "no paged" in paged_unsupported_reason(LlamaConfig(architectures=["FalconForCausalLM"]))


def test_bfloat16_forward_runs_and_stays_close():
    path = tiny_models.tiny_llama_path()
    config = AutoConfig.from_pretrained(path)
    model = build_paged_model(path, config, TorchAttentionBackend(), torch.bfloat16, torch.device("cpu"))
    runner = PagedRunner(model)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    got = model.compute_logits(runner.step({0: PROMPT[:20]}))
    got = torch.cat([got, model.compute_logits(runner.step({0: [PROMPT[20]]}))])
    assert got.dtype == torch.float32
    want = hf_logits(path, PROMPT[:21])
    torch.testing.assert_close(got, want[[19, 20]], atol=0.1, rtol=0.05)


def test_rotary_table_grows_and_matches_the_direct_formula():
    """The cos/sin table (grown past its first 4096 rows when a step needs it) and the 4-op rotation
    give Hugging Face's numbers: cos/sin of position * inv_freq, x * cos + rotate_half(x) * sin."""
    from transformers.models.llama.modeling_llama import rotate_half

    from opentgi.models.layers.rotary import RotaryEmbedding, apply_rotary

    config = AutoConfig.from_pretrained(tiny_models.tiny_llama_path())
    rotary = RotaryEmbedding(config, torch.device("cpu"))
    positions = torch.tensor([0, 7, 4095, 4096, 9000])
    freqs = positions.float().unsqueeze(1) * rotary.inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    x = torch.randn(5, 3, emb.shape[-1]).bfloat16()
    for dtype in (torch.float32, torch.bfloat16):
        cos, signed_sin = rotary.cos_sin(positions[:3], dtype, 4096)
        cos, signed_sin = rotary.cos_sin(positions, dtype, 9001)  # past the first table
        torch.testing.assert_close(cos[:, 0], emb.cos().to(dtype), atol=0, rtol=0)
        half = emb.shape[-1] // 2
        torch.testing.assert_close(signed_sin[:, 0, half:], emb.sin()[:, half:].to(dtype), atol=0, rtol=0)
        torch.testing.assert_close(signed_sin[:, 0, :half], -emb.sin()[:, :half].to(dtype), atol=0, rtol=0)
    cos, signed_sin = rotary.cos_sin(positions, torch.bfloat16, 9001)
    want = x * emb.cos().bfloat16().unsqueeze(1) + rotate_half(x) * emb.sin().bfloat16().unsqueeze(1)
    assert torch.equal(apply_rotary(x, cos, signed_sin), want)
