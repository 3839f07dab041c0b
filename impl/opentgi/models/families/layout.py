"""What a family's config says about the decoder the skeleton builds: one `DecoderLayout`.

Read once from the config (and the family's structure), so that the modules take plain values:
per-layer sliding windows (Mistral, Phi-3, StarCoder2, Mixtral: every layer; Gemma 2/3, Qwen2/3:
`layer_types`), which layers route to experts, the RoPE of each layer, the attention scale and
the soft-capping values.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentgi.models.families.structure import FamilyStructure


@dataclass(frozen=True)
class DecoderLayout:
    structure: FamilyStructure
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    scale: float  # of q.k: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 (Gemma 2/3)
    attn_softcap: float | None  # Gemma 2: tanh(s / cap) * cap on the attention logits
    final_softcap: float | None  # Gemma 2/3: the same on the output logits
    windows: tuple[int | None, ...]  # per layer: a query at i sees keys i - W < j <= i
    local_rope: tuple[bool, ...]  # per layer: the local RoPE (Gemma 3's sliding layers)
    moe: tuple[bool, ...]  # per layer: a routed-experts block instead of the dense MLP
    num_experts: int = 0
    top_k: int = 0
    renormalize: bool = True
    expert_intermediate: int = 0

    @classmethod
    def of(cls, config, structure: FamilyStructure) -> DecoderLayout:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        pre_attn = getattr(config, "query_pre_attn_scalar", None)
        bias = bool(getattr(config, structure.bias_attr, False))
        num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
        return cls(
            structure=structure, hidden=config.hidden_size, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
            eps=_first(config, ("rms_norm_eps", "norm_epsilon", "layer_norm_eps"), 1e-6),
            act=getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"),
            qkv_bias=structure.qkv_bias or bias, o_bias=bias,
            mlp_bias=bool(getattr(config, structure.mlp_bias_attr, False)),
            scale=(pre_attn if pre_attn else head_dim) ** -0.5,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) or None,
            final_softcap=getattr(config, "final_logit_softcapping", None) or None,
            windows=tuple(window_of_layer(config, structure, i) for i in range(layers)),
            local_rope=tuple(structure.local_rope and _layer_type(config, i) == "sliding_attention"
                             for i in range(layers)),
            moe=tuple(structure.mlp == "moe" and _is_moe_layer(config, i) for i in range(layers)),
            num_experts=num_experts, top_k=getattr(config, "num_experts_per_tok", 0) or 0,
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            expert_intermediate=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        )

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one, else None."""
        return self.windows[0] if len(set(self.windows)) == 1 else None


def _first(config, names: tuple[str, ...], default):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _layer_type(config, index: int) -> str | None:
    types = getattr(config, "layer_types", None)
    return types[index] if types else None


def window_of_layer(config, structure: FamilyStructure, index: int) -> int | None:
    window = getattr(config, "sliding_window", None) if structure.sliding_window else None
    if not window:
        return None
    kind = _layer_type(config, index)
    return int(window) if kind in (None, "sliding_attention") else None


def _is_moe_layer(config, index: int) -> bool:
    if index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (index + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0
