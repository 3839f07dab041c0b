"""What sets each family of the paged path apart from the Llama decoder: one `FamilyStructure` each.

The skeleton (`families/decoder.py`) builds every family from its structure and the config; values
the config carries (biases, windows per layer, soft-capping, query scale, rope bases, expert counts)
are read from it there, so a field here is only a structural choice the config does not say.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyStructure:
    norm: str = "rms"  # "rms" | "gemma_rms" ((1 + w), float32) | "layer" (LayerNorm with bias)
    mlp: str = "gated"  # "gated" (SwiGLU/GeGLU) | "plain" (c_fc -> act -> c_proj) | "moe"
    # the checkpoint's (gate, up, down) names; ("gate_up_proj", None, down): stored fused (Phi-3)
    mlp_names: tuple[str, str | None, str] = ("gate_proj", "up_proj", "down_proj")
    mlp_attr: str = "mlp"  # the layer attribute holding the feed-forward block
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_qkv: bool = False  # the checkpoint stores q/k/v as one qkv_proj (Phi-3)
    qkv_bias: bool = False  # q/k/v carry a bias whatever the config says (Qwen2)
    bias_attr: str = "attention_bias"  # the config field that gives every attention projection a bias
    mlp_bias_attr: str = "mlp_bias"
    qk_norm: bool = False  # a norm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden), in the model dtype (Gemma)
    local_rope: bool = False  # sliding-window layers use rope_local_base_freq (Gemma 3)
    sliding_window: bool = True  # the config's sliding_window applies (Llama's code ignores the field)


LLAMA = FamilyStructure()
FAMILIES: dict[str, FamilyStructure] = {
    "llama": FamilyStructure(sliding_window=False),
    "mistral": LLAMA,
    "qwen2": FamilyStructure(qkv_bias=True),
    "qwen3": FamilyStructure(qk_norm=True),
    "qwen3_moe": FamilyStructure(qk_norm=True, mlp="moe"),
    "mixtral": FamilyStructure(mlp="moe", mlp_attr="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    "phi3": FamilyStructure(fused_qkv=True, mlp_names=("gate_up_proj", None, "down_proj")),
    "starcoder2": FamilyStructure(norm="layer", mlp="plain", bias_attr="use_bias", mlp_bias_attr="use_bias"),
    "gemma": FamilyStructure(norm="gemma_rms", embed_scale=True),
    "gemma2": FamilyStructure(norm="gemma_rms", embed_scale=True, sandwich_norms=True),
    "gemma3": FamilyStructure(norm="gemma_rms", embed_scale=True, sandwich_norms=True, qk_norm=True,
                          local_rope=True),
}
