"""What the engine needs of a model served through the paged path.

Contract with the engine's model runner (see models/loader.py for how a model is loaded):
- KV caches: one (k_cache, v_cache) pair per layer, each [num_blocks, block_size, spec.num_kv_heads,
  spec.head_dim], dtype spec.cache_dtype (the engine's --kv-cache-dtype; spec.dtype unless it set
  one), on spec.device. A forward stores k/v rounded to that dtype and every attention form reads
  them as stored, the step's own keys included, so a token's numbers do not depend on the path.
  block_size = LoadedModel.block_size (the attention backend's choice: 16 with the torch backend,
  a multiple of 256 with flash-attn).
- AttentionMetadata (attention/metadata.py): tensors on spec.device; cu_seqlens_q/k, context_lens
  and block_tables int32, slot_mapping int64. Pad block_tables with -1 on CPU (the torch backend
  never reads past context_lens) and with 0 for flash-attn. `decode_only` must be True exactly when
  every sequence has one new token (flash-attn then takes its decode kernel). Build a fresh
  AttentionMetadata per step (backends cache per-step data in `scratch`).
- input_ids / positions: int64 [T] in the varlen order of cu_seqlens_q; positions are each token's
  absolute index in its sequence (context_len - q_len .. context_len - 1).
- forward/compute_logits/compute_score run under torch.inference_mode themselves.
- Pick the rows to sample before compute_logits (usually each sequence's last new token:
  hidden[cu_seqlens_q[1:] - 1]); logits come back float32.
- Reward models (spec.is_reward_model; LightLLM /get_score): no compute_logits; compute_score
  (hidden of each sequence's last token) -> float32 [N] raw scores (no sigmoid).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from opentgi.models.attention.metadata import AttentionMetadata


class ForwardWithoutHooks:
    """Mixed in before nn.Module into the modules a decode step calls per layer: calling one goes
    straight into its `forward`, skipping nn.Module's hook checks and call frames, a visible share
    of a single-stream step (docs/benchmarks.md). Serving registers no hooks; hooks registered on
    these modules are not run."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


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
    # the window every layer shares (a query at position i sees keys i-W < j <= i); None when there
    # is none or the layers differ (Gemma 2/3: families/layout.py has each layer's)
    sliding_window: int | None = None
    is_reward_model: bool = False  # a one-label sequence-classification head (compute_score)
    kv_cache_dtype: torch.dtype | None = None  # the paged KV cache's, set by the engine; None: dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype


class PagedCausalLM(Protocol):
    spec: ModelSpec

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: int64 [T] (varlen layout). Writes this step's k/v into kv_caches
        (one (k_cache, v_cache) per layer) and returns the final hidden states [T, hidden]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""

    def compute_score(self, hidden: torch.Tensor) -> torch.Tensor:
        """Reward models only: hidden [N, hidden] -> float32 raw scores [N]."""
