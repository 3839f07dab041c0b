"""The decoder's self-attention, with each family's extras: q/k/v biases, q and k normed per head
before RoPE (Qwen3, Gemma 3), a query scale of its own (Gemma), soft-capped logits (Gemma 2) and a
sliding window per layer (given to the backend only in a step where it hides a key). Attention itself goes through the backend chosen by
`attention.selector` (torch on CPU, flash-attn on CUDA).

Parameter names follow Hugging Face's checkpoints, so weights load by name; after loading, q/k/v
are one `qkv_proj` matmul (`fuse_projections`; Phi-3 stores them fused already).
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.models.attention.backend import AttentionBackend
from opentgi.models.attention.bidirectional import attend_image_spans
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.families.layout import DecoderLayout
from opentgi.models.layers.mlp import fused_linear
from opentgi.models.layers.norm import HeadsNorm, make_norm
from opentgi.models.layers.rotary import apply_rotary


class DecoderAttention(ForwardWithoutHooks, nn.Module):
    def __init__(self, layout: DecoderLayout, backend: AttentionBackend, sliding_window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.head_dim = d = layout.head_dim
        self.scale = layout.scale
        self.backend = backend
        self.sliding_window = sliding_window
        # only when set, so that a backend without soft-capping is never asked for it
        self.extra = {"softcap": layout.attn_softcap} if layout.attn_softcap else {}
        hidden, q_size, kv_size = layout.hidden, self.num_heads * d, self.num_kv_heads * d
        if layout.structure.fused_qkv:
            self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=layout.qkv_bias)
        else:
            self.q_proj = nn.Linear(hidden, q_size, bias=layout.qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_size, bias=layout.qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_size, bias=layout.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=layout.o_bias)
        self.qk_norm = layout.structure.qk_norm
        if self.qk_norm:
            self.q_norm = make_norm(layout.structure.norm, d, layout.eps)
            self.k_norm = make_norm(layout.structure.norm, d, layout.eps)

    def fuse_projections(self) -> None:
        if "qkv_proj" not in self._modules:
            self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj
        if self.qk_norm:
            self.heads_norm = HeadsNorm(self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads)
            del self.q_norm, self.k_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        # q and k are adjacent columns: normed (Qwen3, Gemma 3) and rotated together, as one
        # [T, heads + kv_heads, D] view
        qk = qkv[:, :q_size + kv_size].view(num_tokens, -1, d)
        if self.qk_norm:
            qk = self.heads_norm(qk)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, d)
        window = self.sliding_window
        if window is not None and window >= meta.max_seqlen_k:
            # no key of this step lies outside it: attended without one, so that the step's
            # windowed and full layers (Gemma 2/3) share one attention plan (the same numbers)
            window = None
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, window, **self.extra)
        if meta.image_spans:  # image tokens that attend each other both ways (Gemma 3)
            out = attend_image_spans(out, q, k_cache, v_cache, meta, self.scale, window,
                                     getattr(self.backend, "batch_invariant", False))
        return self.o_proj(out.reshape(num_tokens, q_size))
