"""Which architectures the paged model code serves, and building one from a checkpoint folder.
Everything else that transformers can load runs on the generic path (models/loader.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from opentgi.models.attention.backend import AttentionBackend
from opentgi.models.base import ModelSpec
from opentgi.models.checkpoints.loading import FolderWeights, load_quantized
from opentgi.models.checkpoints.weights import load_weights
from opentgi.models.families.llama import PagedLlama
from opentgi.models.layers.rotary import SUPPORTED_ROPE_TYPES, rope_type
from opentgi.models.quantization.linear import resident_summary
from opentgi.models.quantization.methods import Quantize

# architecture -> (q/k/v projections carry a bias, head)
PAGED_ARCHITECTURES: dict[str, tuple[bool, str]] = {
    "LlamaForCausalLM": (False, "lm"),
    "MistralForCausalLM": (False, "lm"),
    "Qwen2ForCausalLM": (True, "lm"),
    "LlamaForSequenceClassification": (False, "score"),
    "MistralForSequenceClassification": (False, "score"),
    "Qwen2ForSequenceClassification": (True, "score"),
}


def architecture_of(config) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else type(config).__name__.replace("Config", "ForCausalLM")


def sliding_window_of(config) -> int | None:
    """The attention window the paged code must apply (Mistral's `sliding_window`), or None.
    Llama ignores the field, as transformers does; Qwen2 with use_sliding_window is refused in
    paged_unsupported_reason."""
    if config.model_type != "mistral":
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def paged_unsupported_reason(config) -> str | None:
    """None when the paged path serves this config; else why not (the generic path serves it)."""
    arch = architecture_of(config)
    if arch not in PAGED_ARCHITECTURES:
        return f"architecture {arch} has no paged implementation"
    if PAGED_ARCHITECTURES[arch][1] == "score" and getattr(config, "num_labels", 1) != 1:
        return f"{arch} with num_labels={config.num_labels} is not a reward model"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (paged code implements silu)"
    if rope_type(config) not in SUPPORTED_ROPE_TYPES:
        return f"rope_scaling type {rope_type(config)!r}"
    if config.model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        return "Qwen2 with use_sliding_window (per-layer windows)"
    return None


def build_paged_model(folder, config, backend: AttentionBackend, dtype: torch.dtype,
                      device: torch.device, tp=None, quantize: Quantize | None = None) -> PagedLlama:
    """The model on `device`, from a checkpoint folder or an open GGUFCheckpoint, its linears in
    the formats the checkpoint and `quantize` ask for (models/checkpoints/loading.py); with `tp` (a
    models.parallel.TPGroup of more than one rank) this rank's shard of it, loaded from its slices
    of the checkpoint. `model.resident` says in one line what it holds."""
    reason = paged_unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"cannot serve {folder} on the paged path: {reason}")
    arch = architecture_of(config)
    qkv_bias, head = PAGED_ARCHITECTURES[arch]
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
        sliding_window=sliding_window_of(config),
        is_reward_model=head == "score",
    )
    plan = None
    if tp is not None and tp.world_size > 1:
        from opentgi.models.parallel import ShardPlan

        plan = ShardPlan.of(config, tp.rank, tp.world_size)
        spec.num_kv_heads = plan.num_kv_heads
    with torch.device("meta"):
        model = PagedLlama(config if plan is None else plan.local_config(config), spec, backend, qkv_bias, head)
    ignore = ("lm_head.weight",) if head == "lm" and model.tie_word_embeddings else ()
    if plan is None:
        weights = folder if not isinstance(folder, Path) else FolderWeights(folder, config)
        model = load_quantized(model, weights, quantize, dtype, device, ignore_unexpected=ignore)
    else:
        from opentgi.models.parallel import parallelize

        model = model.to_empty(device=device).to(dtype)
        load_weights(model, folder, ignore_unexpected=ignore, shard=plan.slice)
        parallelize(model, plan, tp)
    model.materialize()
    model.resident = resident_summary(model)
    return model.eval()
