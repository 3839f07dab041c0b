"""Rotary position embedding (RoPE), computed for the step's flat positions.

Supported `rope_scaling` types: none/"default", "linear", "llama3" and "yarn" (static frequency
changes, taken from transformers' own initializers so they match it exactly), and "longrope"
(Phi-3's LongRoPE, "su"): the short factors below `original_max_position_embeddings`, the long
ones from there on, chosen per position (transformers and TGI switch a whole forward to the long
factors once any position passes it; per position, the keys already cached stay valid). "dynamic"
changes with the sequence length: such models are served by the generic path.
"""

from __future__ import annotations

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su")


def rope_type(config) -> str:
    scaling = getattr(config, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return "default" if kind == "mrope" else kind  # M-RoPE's frequencies are the default ones


def local_rope_config(config):
    """Gemma 3's sliding-window layers: plain RoPE with base `rope_local_base_freq`."""
    import copy

    local = copy.copy(config)
    local.rope_theta = config.rope_local_base_freq
    local.rope_scaling = None
    return local


class RotaryEmbedding:
    """Holds the inverse frequencies (a plain tensor, not a buffer: models are built on the meta
    device and materialized empty, which must not wipe them)."""

    def __init__(self, config, device: torch.device):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kind = rope_type(config)
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {kind!r} is not supported by the paged model code "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        self.long_from: int | None = None  # LongRoPE: positions from here on take `long_inv_freq`
        self.long_inv_freq: torch.Tensor | None = None
        with torch.device("cpu"):
            if kind in ("longrope", "su"):
                original = getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"))
                long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=original + 1)
                self.long_from, self.long_inv_freq = original, long_inv_freq.float().to(device)
            else:
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
        self.inv_freq = inv_freq.float().to(device)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # cos, signed sin [n, 1, head_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] (all below `max_position`) -> cos, signed sin [T, 1, head_dim]
        (broadcast over heads; the sine's first half negated, see `apply_rotary`), two row gathers
        from a table kept per dtype, already [n, 1, head_dim], and grown (doubling) when a step
        reaches past it."""
        table = self.tables(dtype, max_position)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def tables(self, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and signed sin tables [n, 1, head_dim] in `dtype`, n >= `max_position`
        (the rows `cos_sin` gathers)."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < max_position:
            size = max(max_position, 2 * table[0].shape[0] if table is not None else 4096)
            table = self._tables[dtype] = self._table(size, dtype)
        return table

    def _table(self, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(size, device=self.inv_freq.device)
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        if self.long_from is not None and size > self.long_from:
            freqs[self.long_from:] = positions[self.long_from:].float().unsqueeze(1) * self.long_inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos.unsqueeze(1), sin.unsqueeze(1)


def mrope_section(config) -> list[int] | None:
    """Qwen2.5-VL's M-RoPE: how many of each head's rotary frequencies take the temporal, height
    and width positions (`rope_scaling.mrope_section`); None for plain RoPE."""
    scaling = getattr(config, "rope_scaling", None)
    section = scaling.get("mrope_section") if isinstance(scaling, dict) else None
    return list(section) if section else None


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (multimodal RoPE): positions int64 [3, T] (temporal, height, width), each head's
    frequencies in three sections that take one of them each (the sections repeat for the second
    half, as the frequencies do). A text token's three positions are equal, so its rows are plain
    RoPE's; 1-D positions (a step without images) are plain RoPE's too."""

    def __init__(self, config, device: torch.device, section: list[int]):
        super().__init__(config, device)
        which = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section * 2)])
        self.which = which.to(device)  # [head_dim]: the position row each column takes

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype, max_position)
        n = positions.shape[1]
        cos, sin = super().cos_sin(positions.reshape(-1), dtype, max_position)
        cos, sin = cos.view(3, n, 1, -1), sin.view(3, n, 1, -1)
        which = self.which

        def pick(t: torch.Tensor) -> torch.Tensor:
            return torch.where(which == 0, t[0], torch.where(which == 1, t[1], t[2]))

        return pick(cos), pick(sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by halves (the Hugging Face / GPT-NeoX layout): Hugging Face's
    `x * cos + cat(-x2, x1) * sin`, as `x * cos + cat(x2, x1) * signed_sin` (the same numbers: a
    negation is exact), in 4 ops instead of 6."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(signed_sin))
