"""What the engine needs of a model served through the paged path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from opentgi.models.attention.metadata import AttentionMetadata


@dataclass
class ModelSpec:
    """The shape facts the engine sizes its KV pool and scheduler by."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None


class PagedCausalLM(Protocol):
    spec: ModelSpec

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: int64 [T] (varlen layout). Writes this step's k/v into kv_caches
        (one (k_cache, v_cache) per layer) and returns the final hidden states [T, hidden]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
