"""Every family of the paged path beside Llama against transformers' own (eager) forward of the same
tiny checkpoint: whole prompts, prefill chunks then decodes, a prefix-cache hit, batched rows, and
greedy tokens. The tiny configs switch on what sets each family apart: sliding windows shorter than
the prompts (per layer for Gemma), soft-capped attention and output logits, routed experts, biases,
LongRoPE, Gemma 3's local RoPE base."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from opentgi.models.registry import architecture_of, paged_unsupported_reason
from tests.helpers import tiny_models
from tests.helpers.paged import BLOCK_SIZE, PROMPT, PagedRunner, load_paged

FAMILIES = list(tiny_models.FAMILY_CONFIGS)
TOL = {"atol": 1e-4, "rtol": 1e-4}


@functools.cache
def hf_model(family: str):
    path = tiny_models.tiny_family_path(family)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@functools.cache
def paged_model(family: str):
    return load_paged(tiny_models.tiny_family_path(family))


def hf_logits(family: str, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(family)(torch.tensor([prompt])).logits[0].float()


class SharingRunner(PagedRunner):
    def share_prefix(self, source: int, target: int, blocks: int) -> None:
        """`target` starts with `source`'s first full blocks (a prefix-cache hit)."""
        self.tables[target] = list(self.tables[source][:blocks])
        self.lengths[target] = blocks * BLOCK_SIZE


@pytest.mark.parametrize("family", FAMILIES)
def test_family_takes_the_paged_path_with_its_parts(family):
    config = AutoConfig.from_pretrained(tiny_models.tiny_family_path(family))
    assert paged_unsupported_reason(config) is None
    model = paged_model(family)
    layout = model.layout
    assert model.spec.architecture == architecture_of(config)
    if family in ("gemma2", "gemma3"):  # alternating windows: layer 0 local, layer 1 global
        assert layout.windows == (tiny_models._WINDOW, None)
        assert layout.structure.sandwich_norms and layout.structure.embed_scale and layout.final_softcap == 5.0
    if family == "gemma2":
        assert layout.attn_softcap == 2.0
    if family == "gemma3":
        assert layout.local_rope == (True, False) and len(model.rotary) == 2
    if family in ("starcoder2", "phi3"):
        assert None not in layout.windows
    if family in ("mixtral", "qwen3_moe"):
        assert layout.moe == ((True, True) if family == "mixtral" else (True, False))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_chunks_and_decodes_match_transformers(family):
    model = paged_model(family)
    expected = hf_logits(family, PROMPT)

    hidden = PagedRunner(model).step({0: PROMPT})
    torch.testing.assert_close(model.compute_logits(hidden)[0], expected[-1], **TOL)

    runner = PagedRunner(model)
    got = [model.compute_logits(runner.step({0: PROMPT[:13]}))[0]]
    got.append(model.compute_logits(runner.step({0: PROMPT[13:25]}))[0])
    for t in range(25, len(PROMPT)):
        got.append(model.compute_logits(runner.step({0: [PROMPT[t]]}))[0])
    torch.testing.assert_close(torch.stack(got), torch.stack([expected[12], expected[24], *expected[25:]]), **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hit_and_batched_rows_match_transformers(family):
    """Sequence 1 reuses sequence 0's first block (16 tokens) and computes only its tail, in the
    same step as a decode of 0 and a fresh prompt 2."""
    model = paged_model(family)
    runner = SharingRunner(model)
    runner.step({0: PROMPT[:20]})
    runner.share_prefix(0, 1, 1)
    other = PROMPT[:16] + PROMPT[25:35]
    fresh = PROMPT[3:14]
    logits = model.compute_logits(runner.step({0: [PROMPT[20]], 1: other[16:], 2: fresh}))
    torch.testing.assert_close(logits[0], hf_logits(family, PROMPT[:21])[-1], **TOL)
    torch.testing.assert_close(logits[1], hf_logits(family, other)[-1], **TOL)
    torch.testing.assert_close(logits[2], hf_logits(family, fresh)[-1], **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(family):
    model = paged_model(family)
    prompt = PROMPT[:12]
    with torch.no_grad():
        want = hf_model(family).generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                         pad_token_id=2, eos_token_id=None)[0, len(prompt):].tolist()
    runner = PagedRunner(model)
    tokens, feed = [], prompt
    for _ in range(10):
        token = int(model.compute_logits(runner.step({0: feed}))[0].argmax())
        tokens.append(token)
        feed = [token]
    assert tokens == want


def test_a_window_reaches_the_backend_only_in_a_step_where_it_hides_a_key(monkeypatch):
    """Gemma 2's layer 0 has a window of 8: a step of at most 8 keys attends it as the full layer
    (one attention plan for the step), a longer one through the window; transformers' logits
    either way."""
    model = paged_model("gemma2")
    backend = model.model.layers[0].self_attn.backend
    forward, windows = backend.forward, []

    def spy(q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, **extra):
        windows.append(sliding_window)
        return forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, **extra)

    monkeypatch.setattr(backend, "forward", spy)
    runner = PagedRunner(model)
    window = tiny_models._WINDOW
    logits = [model.compute_logits(runner.step({0: PROMPT[:window]}))[0]]
    assert windows == [None, None]
    logits.append(model.compute_logits(runner.step({0: [PROMPT[window]]}))[0])
    assert windows[2:] == [window, None]
    expected = hf_logits("gemma2", PROMPT[:window + 1])
    torch.testing.assert_close(torch.stack(logits), expected[window - 1:], **TOL)


def test_qwen2_per_layer_windows_match_transformers():
    """Qwen2 with use_sliding_window: layers from max_window_layers on attend through the window."""
    path = tiny_models.tiny_qwen2_path(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = load_paged(path)
    assert model.layout.windows == (None, 8)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    runner = PagedRunner(model)
    got = [model.compute_logits(runner.step({0: PROMPT[:20]}))[0]]
    for t in range(20, len(PROMPT)):
        got.append(model.compute_logits(runner.step({0: [PROMPT[t]]}))[0])
    torch.testing.assert_close(torch.stack(got), expected[19:], **TOL)


def test_longrope_takes_the_long_factors_from_the_original_length_on():
    """Phi-3's LongRoPE: positions below original_max_position_embeddings rotate as transformers
    does for a short sequence, positions from there on as it does for a long one."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from opentgi.models.layers.rotary import RotaryEmbedding

    config = AutoConfig.from_pretrained(tiny_models.tiny_family_path("phi3", original_max_position_embeddings=64,
                                                                     max_position_embeddings=512))
    ours = RotaryEmbedding(config, torch.device("cpu"))
    hf = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, 1, 16)
    short, long = torch.arange(0, 64), torch.arange(64, 200)
    cos, _ = ours.cos_sin(torch.cat([short, long]), torch.float32, 512)
    want_short, _ = hf(x, short.unsqueeze(0))
    want_long, _ = hf(x, long.unsqueeze(0))
    torch.testing.assert_close(cos[:64, 0], want_short[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cos[64:, 0], want_long[0], atol=1e-6, rtol=1e-6)
    freqs = long.float().unsqueeze(1) * hf.original_inv_freq.unsqueeze(0)  # the short factors there
    assert not torch.allclose(cos[64:, 0], torch.cat([freqs, freqs], -1).cos() * hf.attention_scaling)


LORA_TARGETS = {"gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],  # experts: tests/models/test_lora_experts.py
                "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused in the checkpoint
                "starcoder2": ["q_proj", "v_proj", "c_fc", "c_proj"]}


@pytest.mark.parametrize("family", list(LORA_TARGETS))
def test_lora_adapter_matches_peft(family):
    """A PEFT adapter on a family beside Llama: a row with the adapter and a base row in one step,
    then decodes, give PEFT's logits and the base model's."""
    from peft import PeftModel

    from opentgi.models.lora import attach_lora, load_adapters

    path = tiny_models.tiny_family_path(family)
    adapter = tiny_models.tiny_lora_path(path, seed=3, r=4, alpha=8, targets=LORA_TARGETS[family])
    model = load_paged(path)
    attach_lora(model, load_adapters(f"a={adapter}", model.config, str(path)))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want_base = base(torch.tensor([PROMPT])).logits[0]
        want_lora = PeftModel.from_pretrained(base, str(adapter)).eval()(torch.tensor([PROMPT])).logits[0]
    assert not torch.allclose(want_base, want_lora, atol=1e-2)
    runner, got = PagedRunner(model), []
    for start, end in ((0, 20), (20, 21), (21, 22)):
        model.lora.begin_step(["a", None], [end - start] * 2)
        got.append(model.compute_logits(runner.step({0: PROMPT[start:end], 1: PROMPT[start:end]})))
        model.lora.end_step()
    got = torch.stack(got)  # [steps, rows, vocab]
    torch.testing.assert_close(got[:, 0], want_lora[[19, 20, 21]], **TOL)
    torch.testing.assert_close(got[:, 1], want_base[[19, 20, 21]], **TOL)


def test_lora_adapter_for_projections_the_model_lacks_is_refused():
    from opentgi.models.lora import LoraAdapterError, attach_lora, load_adapters

    llama = tiny_models.tiny_llama_path()
    adapter = tiny_models.tiny_lora_path(tiny_models.tiny_family_path("starcoder2"), seed=3, r=4, alpha=8,
                                         targets=["c_fc"])
    model = load_paged(llama)
    with pytest.raises(LoraAdapterError, match="targets c_fc of layer 0, which LlamaForCausalLM does not have"):
        attach_lora(model, load_adapters(f"a={adapter}", model.config, str(llama)))


def test_gemma3_multimodal_checkpoint_serves_its_text_tower_on_the_paged_path():
    """Gemma 3's larger checkpoints are Gemma3ForConditionalGeneration: the paged path loads the
    text tower's tensors (the vision tower's and the projector's skipped) and computes
    transformers' logits of the whole model for text prompts: whole, then chunks and decodes."""
    from transformers import Gemma3ForConditionalGeneration

    from opentgi.models.attention.torch_backend import TorchAttentionBackend
    from opentgi.models.checkpoints.text_tower import text_config
    from opentgi.models.registry import build_paged_model

    path = tiny_models.tiny_gemma3_multimodal_path()
    config = text_config(AutoConfig.from_pretrained(path))
    assert config.architectures == ["Gemma3ForConditionalGeneration"] and config.model_type == "gemma3_text"
    assert paged_unsupported_reason(config) is None
    model = build_paged_model(path, config, TorchAttentionBackend(), torch.float32, torch.device("cpu"))
    assert model.spec.architecture == "Gemma3ForConditionalGeneration"
    assert model.layout.windows == (tiny_models._WINDOW, None) and len(model.rotary) == 2
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = hf.eval()(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(model.compute_logits(PagedRunner(model).step({0: PROMPT}))[0], expected[-1], **TOL)
    runner = PagedRunner(model)
    got = [model.compute_logits(runner.step({0: PROMPT[:13]}))[0]]
    got += [model.compute_logits(runner.step({0: [token]}))[0] for token in PROMPT[13:20]]
    torch.testing.assert_close(torch.stack(got), expected[12:20], **TOL)


def test_text_tower_tensor_names_of_both_saved_layouts():
    from opentgi.models.checkpoints.text_tower import text_tower_name

    assert text_tower_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_tower_name("model.language_model.norm.weight") == "model.norm.weight"
    assert text_tower_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_tower_name("lm_head.weight") == "lm_head.weight"
    for skipped in ("vision_tower.vision_model.post_layernorm.weight", "model.vision_tower.vision_model.head.probe",
                    "multi_modal_projector.mm_input_projection_weight",
                    "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert text_tower_name(skipped) is None
