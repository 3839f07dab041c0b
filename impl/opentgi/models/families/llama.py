"""Llama-family decoder for the paged path: Llama (SmolLM2), Mistral, Qwen2, and their one-label
sequence-classification (reward) variants.

Parameter names follow Hugging Face's checkpoints, so weights load by name; after loading,
q/k/v and gate/up projections are fused into one matmul each (`fuse_projections`). Attention goes
through the backend chosen by `attention.selector` (torch on CPU, flash-attn on CUDA).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.attention.backend import AttentionBackend
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.base import ModelSpec
from opentgi.models.layers.linear import OneDNNLinear, onednn_linear_usable, pack_linears
from opentgi.models.layers.norm import RMSNorm
from opentgi.models.layers.rotary import RotaryEmbedding, apply_rotary
from opentgi.models.quantization.linear import fuse_linears

log = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    def __init__(self, config, backend: AttentionBackend, qkv_bias: bool, sliding_window: int | None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.backend = backend
        self.sliding_window = sliding_window
        out_bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=out_bias)
        self.qkv_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        # q and k are adjacent columns: rotated together, as one [T, heads + kv_heads, D] view
        qk = apply_rotary(qkv[:, :q_size + kv_size].view(num_tokens, -1, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate = config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, self.intermediate, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, backend, qkv_bias: bool, sliding_window: int | None):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, qkv_bias, sliding_window)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, meta, kv_cache):
        h = self.self_attn(self.input_layernorm(h), cos, sin, meta, *kv_cache).add_(h)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class LlamaModel(nn.Module):
    def __init__(self, config, backend, qkv_bias: bool, sliding_window: int | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, backend, qkv_bias, sliding_window)
                                     for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# A tied LM head gets its own copy in oneDNN's layout only up to this size: on the default model
# (54 MiB in bfloat16) the copy took the head from 3.6 to 2.3 ms a step, a tenth of the step; on a
# 1B model (192 MiB) it is a fifth of the resident weights for a few percent of the step.
TIED_HEAD_COPY_MAX_BYTES = 64 << 20


class PagedLlama(nn.Module):
    """A `PagedCausalLM` (models/base.py). `head` is "lm" (causal LM) or "score" (reward model)."""

    def __init__(self, config, spec: ModelSpec, backend: AttentionBackend, qkv_bias: bool, head: str):
        super().__init__()
        self.config = config
        self.spec = spec
        self.is_reward_model = head == "score"
        self.model = LlamaModel(config, backend, qkv_bias, spec.sliding_window)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and head == "lm"
        if head == "score":
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        elif not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # set by `materialize` (needs the real device)
        self.logits_proj: OneDNNLinear | None = None  # the LM head in oneDNN's layout (CPU float32/bfloat16)

    def materialize(self) -> None:
        """After the weights are loaded: fuse projections (quantized ones too, where their formats
        stack: models/quantization/linear.py), set up RoPE on the real device, and on CPU in
        float32 or bfloat16 run the dense linear layers through oneDNN (models/layers/linear.py)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        device = torch.device(self.spec.device)
        self.rotary = RotaryEmbedding(self.config, self.spec.device)
        if onednn_linear_usable(device, self.spec.dtype):
            pack_linears(self.model.layers)
            tied = self.tie_word_embeddings
            embedding = self.model.embed_tokens.weight
            copy_worth_it = not tied or embedding.numel() * embedding.element_size() <= TIED_HEAD_COPY_MAX_BYTES
            if not self.is_reward_model and copy_worth_it and (tied or isinstance(self.lm_head, nn.Linear)):
                self.logits_proj = OneDNNLinear(self.model.embed_tokens.weight if tied else self.lm_head.weight)
                if not tied:
                    del self.lm_head

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype, attn.max_seqlen_k)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, attn, kv_cache)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.is_reward_model:
            raise TypeError("a reward model has no language-model head: use compute_score")
        if self.logits_proj is not None:
            return self.logits_proj(hidden).float()
        if not self.tie_word_embeddings:
            return self.lm_head(hidden).float()  # nn.Linear, or a QuantizedLinear
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    @torch.inference_mode()
    def compute_score(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (each sequence's last token) -> float32 raw scores [N]."""
        if not self.is_reward_model:
            raise TypeError("only a reward (sequence-classification) model has compute_score")
        return self.score(hidden).float()[:, 0]
