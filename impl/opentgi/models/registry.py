"""Which architectures the paged model code serves, and building one from a checkpoint folder.
Everything else that transformers can load runs on the generic path (models/loader.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from opentgi.models.attention.backend import AttentionBackend
from opentgi.models.base import ModelSpec
from opentgi.models.checkpoints.loading import FolderWeights, load_quantized
from opentgi.models.checkpoints.text_tower import tensor_renamer
from opentgi.models.checkpoints.weights import load_weights
from opentgi.models.families.decoder import PagedDecoder
from opentgi.models.families.layout import DecoderLayout
from opentgi.models.families.structure import FAMILIES
from opentgi.models.layers.elementwise import ACTIVATIONS
from opentgi.models.layers.rotary import SUPPORTED_ROPE_TYPES, rope_type
from opentgi.models.quantization.linear import resident_summary
from opentgi.models.quantization.methods import Quantize

# architecture -> (family: its structure in families/structure.py, head)
PAGED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "lm"),
    "MistralForCausalLM": ("mistral", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "Qwen3ForCausalLM": ("qwen3", "lm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "lm"),
    "MixtralForCausalLM": ("mixtral", "lm"),
    "GemmaForCausalLM": ("gemma", "lm"),
    "Gemma2ForCausalLM": ("gemma2", "lm"),
    "Gemma3ForCausalLM": ("gemma3", "lm"),
    "Gemma3ForConditionalGeneration": ("gemma3", "lm"),  # its text tower (checkpoints/text_tower.py)
    "Idefics3ForConditionalGeneration": ("llama", "lm"),  # and its image encoder (models/vision/)
    "Qwen2_5_VLForConditionalGeneration": ("qwen2", "lm"),  # M-RoPE, and its image encoder
    # a Llama or Mistral text model (the config's sliding window where it has one), and its image encoder
    "LlavaNextForConditionalGeneration": ("mistral", "lm"),
    "Phi3ForCausalLM": ("phi3", "lm"),
    "Starcoder2ForCausalLM": ("starcoder2", "lm"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "MistralForSequenceClassification": ("mistral", "score"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
}


def architecture_of(config) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else type(config).__name__.replace("Config", "ForCausalLM")


def paged_unsupported_reason(config, pooling_head: str | None = None) -> str | None:
    """None when the paged path serves this config; else why not (the generic path serves it).
    `pooling_head` ("none" or "score": a pooling model's body, models/pooling/paged.py): the family
    is the config's `model_type`, whatever its architecture names."""
    arch = architecture_of(config)
    if pooling_head is not None:
        if getattr(config, "model_type", None) not in FAMILIES:
            return f"model type {getattr(config, 'model_type', None)!r} has no paged implementation"
    elif arch not in PAGED_ARCHITECTURES:
        return f"architecture {arch} has no paged implementation"
    elif PAGED_ARCHITECTURES[arch][1] == "score" and getattr(config, "num_labels", 1) != 1:
        return f"{arch} with num_labels={config.num_labels} is not a reward model"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"hidden_act {act!r} (paged code implements {', '.join(ACTIVATIONS)})"
    if rope_type(config) not in SUPPORTED_ROPE_TYPES:
        return f"rope_scaling type {rope_type(config)!r}"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return f"partial_rotary_factor {config.partial_rotary_factor} (RoPE on part of each head)"
    kinds = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if kinds:
        return f"layer_types {sorted(kinds)}"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention (not a causal decoder)"
    return None


def _image_encoder(arch: str, config) -> torch.nn.Module:
    if arch == "Gemma3ForConditionalGeneration":
        from opentgi.models.vision.gemma3 import Gemma3Vision

        return Gemma3Vision(config)
    if arch == "Qwen2_5_VLForConditionalGeneration":
        from opentgi.models.vision.qwen2_5_vl import Qwen2_5_VLVision

        return Qwen2_5_VLVision(config)
    if arch == "LlavaNextForConditionalGeneration":
        from opentgi.models.vision.llava_next import LlavaNextVision

        return LlavaNextVision(config)
    from opentgi.models.vision.idefics3 import Idefics3Vision

    return Idefics3Vision(config)


def build_paged_model(folder, config, backend: AttentionBackend, dtype: torch.dtype,
                      device: torch.device, tp=None, quantize: Quantize | None = None,
                      batch_invariant: bool = True, native_types: frozenset[int] = frozenset(),
                      pooling_head: str | None = None) -> PagedDecoder:
    """The model on `device`, from a checkpoint folder or an open GGUFCheckpoint, its linears in
    the formats the checkpoint and `quantize` ask for (models/checkpoints/loading.py); with `tp` (a
    models.parallel.TPGroup of more than one rank) this rank's shard of it, loaded from its slices
    of the checkpoint. `batch_invariant` (the default; False with --nondeterministic): a row's
    numbers do not depend on the rest of the step (docs/determinism.md). `native_types`: the GGML
    block types the native kernels serve, where quantized values take their layouts
    (models/quantization/native_layouts.py). `pooling_head`: as paged_unsupported_reason's.
    `model.resident` says in one line what it holds."""
    reason = paged_unsupported_reason(config, pooling_head)
    if reason is not None:
        raise ValueError(f"cannot serve {folder} on the paged path: {reason}")
    arch = architecture_of(config)
    family, head = (config.model_type, pooling_head) if pooling_head else PAGED_ARCHITECTURES[arch]
    num_heads = config.num_attention_heads
    spec = ModelSpec(
        architecture=arch,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        dtype=dtype,
        device=device,
        sliding_window=DecoderLayout.of(config, FAMILIES[family]).uniform_window,
        is_reward_model=head == "score",
    )
    plan = None
    if tp is not None and tp.world_size > 1 and getattr(config, "vision_source", None) is not None:
        raise ValueError(f"--num-shard with {arch} (an image encoder beside the text model) is not "
                         f"supported yet; serve it with one shard")
    if tp is not None and tp.world_size > 1:
        from opentgi.models.parallel import ShardPlan

        plan = ShardPlan.of(config, tp.rank, tp.world_size)
        spec.num_kv_heads = plan.num_kv_heads
    with torch.device("meta"):
        local = config if plan is None else plan.local_config(config)
        model = PagedDecoder(local, spec, backend, DecoderLayout.of(local, FAMILIES[family]), head)
        if getattr(config, "vision_source", None) is not None:  # an image-taking checkpoint
            model.vision = _image_encoder(arch, config.vision_source)
    ignore = ("lm_head.weight",) if head == "lm" and model.tie_word_embeddings else ()
    if plan is None:
        weights = folder if not isinstance(folder, Path) else FolderWeights(folder, config)
        model = load_quantized(model, weights, quantize, dtype, device, ignore_unexpected=ignore,
                               native_types=native_types)
    else:
        from opentgi.models.parallel import parallelize

        model = model.to_empty(device=device).to(dtype)
        load_weights(model, folder, ignore_unexpected=ignore, shard=plan.slice, rename=tensor_renamer(config))
        parallelize(model, plan, tp)
    model.materialize(batch_invariant=batch_invariant)
    model.resident = resident_summary(model)
    return model.eval()
