"""Rotary position embedding (RoPE), computed for the step's flat positions.

Supported `rope_scaling` types: none/"default", "linear", "llama3" and "yarn" (static frequency
changes, taken from transformers' own initializers so they match it exactly). "dynamic" and
"longrope" change with the sequence length: such models are served by the generic path.
"""

from __future__ import annotations

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(config) -> str:
    scaling = getattr(config, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


class RotaryEmbedding:
    """Holds the inverse frequencies (a plain tensor, not a buffer: models are built on the meta
    device and materialized empty, which must not wipe them)."""

    def __init__(self, config, device: torch.device):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kind = rope_type(config)
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {kind!r} is not supported by the paged model code "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
        self.inv_freq = inv_freq.float().to(device)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # cos, signed sin [n, head_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] (all below `max_position`) -> cos, signed sin [T, 1, head_dim]
        (broadcast over heads; the sine's first half negated, see `apply_rotary`), two row gathers
        from a table kept per dtype and grown (doubling) when a step reaches past it."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < max_position:
            size = max(max_position, 2 * table[0].shape[0] if table is not None else 4096)
            table = self._tables[dtype] = self._table(size, dtype)
        return table[0].index_select(0, positions).unsqueeze(1), table[1].index_select(0, positions).unsqueeze(1)

    def _table(self, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(size, device=self.inv_freq.device)
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by halves (the Hugging Face / GPT-NeoX layout): Hugging Face's
    `x * cos + cat(-x2, x1) * sin`, as `x * cos + cat(x2, x1) * signed_sin` (the same numbers: a
    negation is exact), in 4 ops instead of 6."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(signed_sin))
