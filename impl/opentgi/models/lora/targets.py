"""The PEFT modules LoRA applies to and each one's shape in the base model.

PEFT names a projection by its module in the checkpoint: q/k/v/o and gate/up/down of the Llama
layout, Phi-3's checkpoint-fused qkv_proj/gate_up_proj, StarCoder2's c_fc/c_proj, a routed-experts
block's `experts.E.<name>` (Mixtral's w1/w3/w2 = gate/up/down) and its router (`gate`).
"""

from __future__ import annotations

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's (fused) projections and the PEFT modules each one holds, in output order.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
# Other families' projections, each its own PEFT module: Phi-3's checkpoint-fused q/k/v and
# gate/up, StarCoder2's MLP.
OTHER_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("qkv_proj",)),
    "gate_up_proj": ("mlp", ("gate_up_proj",)),
    "c_fc": ("mlp", ("c_fc",)),
    "c_proj": ("mlp", ("c_proj",)),
}
# A routed-experts block's (`mlp` in Qwen3-MoE, `block_sparse_moe` in Mixtral): each expert's
# projections (`experts.E.<name>`, Mixtral's w1/w3/w2 = gate/up/down) and the router (`gate`).
EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")
ROUTER = "gate"
ACCEPTED_MODULES = TARGET_MODULES + ("qkv_proj", "gate_up_proj", "c_fc", "c_proj", "w1", "w3", "w2", ROUTER)


def shape_key(module: str) -> str:
    """`experts.3.w1` -> `experts.w1` (every expert's projection has one shape); others as they are."""
    return f"experts.{module.rsplit('.', 1)[1]}" if module.startswith("experts.") else module


def expert_of(module: str) -> int | None:
    """The expert index of an `experts.E.<name>` module, else None."""
    return int(module.split(".")[1]) if module.startswith("experts.") else None


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT target module of a Llama-family config (an expert's by `shape_key`)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    expert = getattr(config, "moe_intermediate_size", None) or inter
    experts = {f"experts.{m}": (expert, hidden) if m in ("down_proj", "w2") else (hidden, expert)
               for m in EXPERT_MODULES}
    return {**experts, ROUTER: (hidden, num_experts(config)),
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden), "qkv_proj": (hidden, heads * head_dim + 2 * kv),
            "gate_up_proj": (hidden, 2 * inter), "c_fc": (hidden, inter), "c_proj": (inter, hidden)}


def num_experts(config) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
