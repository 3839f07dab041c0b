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
from opentgi.models.layers.linear import (
    OneDNNLinear,
    RowTiledLinear,
    onednn_linear_usable,
    pack_linears,
    tile_linears,
)
from opentgi.models.layers.norm import RMSNorm
from opentgi.models.layers.rotary import RotaryEmbedding, apply_rotary
from opentgi.models.quantization.int4 import Int4Grid, Int4Switch, Int4Weight, int4_rows_worth_it

log = logging.getLogger(__name__)


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    first = parts[0]
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=has_bias,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


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
        self.qkv_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
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
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
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


# packed linear -> the checkpoint projections it holds, stacked in this order
_INT4_SOURCES = {
    ("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "o_proj"): ("self_attn.o_proj",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down_proj"): ("mlp.down_proj",),
}


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
        # the LM head in oneDNN's layout (CPU float32/bfloat16), or row-tiled (batch invariance)
        self.logits_proj: OneDNNLinear | RowTiledLinear | None = None
        # generation steps of at most this many rows use the 4-bit layer weights (`_attach_int4`)
        self.int4_max_rows = 0
        self.int4_switch = Int4Switch()
        self.batch_invariant = False  # set by `materialize`

    def materialize(self, int4_grids: dict[str, Int4Grid] | None = None, batch_invariant: bool = False) -> None:
        """After the weights are loaded: fuse projections, set up RoPE on the real device, and on
        CPU in float32 or bfloat16 run the linear layers through oneDNN (models/layers/linear.py).
        `int4_grids` (checkpoint name -> grid) holds the layer weights found on a 4-bit grid at
        loading: with bfloat16 they also get a 4-bit copy for small steps (models/quantization/int4.py).
        `batch_invariant`: linears and attention in the forms whose rows do not depend on the
        step's other rows (docs/determinism.md)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        self.rotary = RotaryEmbedding(self.config, self.spec.device)
        device = torch.device(self.spec.device)
        onednn = onednn_linear_usable(device, self.spec.dtype)
        backend = self.model.layers[0].self_attn.backend if self.model.layers else None
        # built and measured on the CPU path only: the torch attention backend, oneDNN's linears or
        # row-tiled F.linear where oneDNN has no kernel for the dtype
        self.batch_invariant = batch_invariant and device.type == "cpu" and getattr(backend, "name", None) == "torch"
        if batch_invariant and not self.batch_invariant:
            log.warning("batch invariance is built for the CPU path; this model runs without it "
                        "(docs/determinism.md)")
        if backend is not None:
            backend.batch_invariant = self.batch_invariant
        head_weight = None
        if not self.is_reward_model:
            head_weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        if onednn:
            pack_linears(self.model.layers, row_invariant=self.batch_invariant)
            if int4_grids:
                self._attach_int4(int4_grids)
            if head_weight is not None:
                self.logits_proj = OneDNNLinear(head_weight)
                if self.batch_invariant:
                    self.logits_proj.make_row_invariant(head_weight)
        elif self.batch_invariant:
            tile_linears(self.model.layers)
            if head_weight is not None:
                self.logits_proj = RowTiledLinear(head_weight)
        if self.logits_proj is not None and not self.tie_word_embeddings:
            del self.lm_head

    def _attach_int4(self, grids: dict[str, Int4Grid]) -> None:
        """Give each packed layer linear whose checkpoint weights all lie on a 4-bit grid its 4-bit
        copy, then keep them only if the kernel is measured faster here, and for which steps."""
        linears = []
        for i, layer in enumerate(self.model.layers):
            for (block, attr), sources in _INT4_SOURCES.items():
                linear = getattr(getattr(layer, block), attr)
                parts = [grids.get(f"model.layers.{i}.{source}.weight") for source in sources]
                if isinstance(linear, OneDNNLinear) and all(part is not None for part in parts):
                    linear.int4 = Int4Weight(Int4Grid.cat(parts), self.spec.dtype)
                    linears.append(linear)
        self.int4_max_rows = int4_rows_worth_it(linears)
        for linear in linears:
            if self.int4_max_rows:
                linear.int4_switch = self.int4_switch
            else:
                linear.int4 = None
        log.info("%d of %d layer weights are 4-bit in the checkpoint; their 4-bit copies serve "
                 "generation steps of at most %d rows", len(linears), 4 * len(self.model.layers),
                 self.int4_max_rows)

    def cover_int4_rows(self, rows: int) -> None:
        """Where 4-bit copies serve small steps, let them serve steps of up to `rows` rows too.
        With `--speculate N`, rows = N + 1: a lone sequence's verify step (its last token and N
        drafts) then computes with the same weights, and so the same numbers (the kernel's rows are
        independent of each other), as decoding those tokens one per step."""
        if self.int4_max_rows:
            self.int4_max_rows = max(self.int4_max_rows, rows)

    def use_int4_for(self, num_tokens: int, generated_only: bool) -> None:
        """Before each forward: the 4-bit copies serve this step if it is small enough and feeds
        only generated tokens (decode rows, verify rows). Prompt tokens always take the dense
        weights, so a prompt computes the same with or without a prefix-cache hit, and a request
        decoded alone computes the same with or without --speculate."""
        self.int4_switch.on = generated_only and 0 < num_tokens <= self.int4_max_rows

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
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.inference_mode()
    def compute_score(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (each sequence's last token) -> float32 raw scores [N]."""
        if not self.is_reward_model:
            raise TypeError("only a reward (sequence-classification) model has compute_score")
        return self.score(hidden).float()[:, 0]
