"""load_model: paged vs generic path, ids and templates, errors; the default model (slow)."""

from __future__ import annotations

import pytest
import torch

from opentgi.config import Settings
from opentgi.models.loader import ModelLoadError, load_model


def test_llama_loads_on_the_paged_path(tiny_llama):
    loaded = load_model(Settings(model_id=str(tiny_llama)))
    assert loaded.kind == "paged" and loaded.attention_backend == "native"  # --kernels auto, built here
    assert loaded.block_size == 16
    assert loaded.spec.architecture == "LlamaForCausalLM"
    assert (loaded.spec.num_layers, loaded.spec.num_kv_heads, loaded.spec.head_dim) == (2, 2, 16)
    assert loaded.spec.dtype == torch.float32 and loaded.spec.device.type == "cpu"
    assert loaded.eos_token_ids == [2, 0] == loaded.spec.eos_token_ids
    assert "<|im_start|>" in loaded.chat_template
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.tokenizer("Hello world").input_ids == [19556, 905]
    assert loaded.pipeline_tag == "text-generation" and not loaded.is_reward_model
    assert loaded.model_id == str(tiny_llama) and loaded.model_sha is None


def test_gpt2_loads_on_the_generic_path(tiny_gpt2, caplog):
    with caplog.at_level("WARNING", logger="opentgi.models.loader"):
        loaded = load_model(Settings(model_id=str(tiny_gpt2), block_size=32))
    said = [r.getMessage() for r in caplog.records if r.name == "opentgi.models.loader"]
    assert said == ["GPT2LMHeadModel runs on the generic transformers path (architecture GPT2LMHeadModel "
                    "has no paged implementation): no prefix cache, no --num-shard, no LoRA adapters, "
                    "no --speculate"]
    assert loaded.kind == "generic" and loaded.attention_backend is None
    assert type(loaded.model).__name__ == "GPT2LMHeadModel" and not loaded.model.training
    assert loaded.spec.num_layers == 2 and loaded.spec.max_position_embeddings == 2048
    assert loaded.block_size == 32


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "starcoder2", "mixtral"])
def test_families_load_on_the_paged_path_without_a_word(family, caplog):
    from tests.helpers import tiny_models

    with caplog.at_level("WARNING", logger="opentgi.models.loader"):
        loaded = load_model(Settings(model_id=str(tiny_models.tiny_family_path(family)), dtype="float32"))
    assert loaded.kind == "paged" and not [r for r in caplog.records if r.name == "opentgi.models.loader"]


def test_reward_model_is_flagged(tiny_reward):
    loaded = load_model(Settings(model_id=str(tiny_reward)))
    assert loaded.kind == "paged" and loaded.is_reward_model
    assert loaded.pipeline_tag == "text-classification"


def test_dtype_setting_is_applied(tiny_qwen2):
    loaded = load_model(Settings(model_id=str(tiny_qwen2), dtype="bfloat16"))
    assert loaded.spec.dtype == torch.bfloat16
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_unknown_model_id_fails_clearly(tmp_path, monkeypatch, hub_offline):
    _use_hub_cache(monkeypatch, tmp_path)
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        load_model(Settings(model_id="no-such-org/no-such-model"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(Settings(model_id=str(tmp_path / "missing.gguf")))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(Settings(model_id=str(tmp_path), dtype="float8"))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(Settings(model_id=str(tmp_path / "sub")))


@pytest.fixture
def hub_offline(monkeypatch):
    """huggingface_hub in offline mode for one test. Its HTTP session is cached and built for the
    mode in force, so it is reset on both sides: later tests' clients (InferenceClient against our
    live server) must not inherit an offline session."""
    import huggingface_hub.constants as hub_constants
    from huggingface_hub.utils import reset_sessions

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    reset_sessions()
    yield
    monkeypatch.undo()
    reset_sessions()


def _use_hub_cache(monkeypatch, cache):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))


def test_hub_id_found_in_the_cache_reports_its_commit(tmp_path, monkeypatch, hub_offline, tiny_llama):
    import shutil

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_llama, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    _use_hub_cache(monkeypatch, tmp_path)
    loaded = load_model(Settings(model_id="tiny-org/tiny-llama"))
    assert loaded.kind == "paged"
    assert loaded.model_id == "tiny-org/tiny-llama" and loaded.model_sha == sha


def test_sharded_checkpoint_loads(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.paged import PROMPT, PagedRunner

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, max_shard_size="2MB")
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_model(Settings(model_id=str(tmp_path)))
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1]
    got = loaded.model.compute_logits(PagedRunner(loaded.model).step({0: PROMPT}))[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
