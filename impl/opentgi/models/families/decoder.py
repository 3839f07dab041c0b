"""One decoder skeleton for every family of the paged path, built from the family's parts
(`families/parts.py`) and what its config says (`families/layout.py`), plus the one-label
sequence-classification (reward) head.

A layer is norm -> attention -> residual -> norm -> feed-forward -> residual; with sandwich norms
(Gemma 2/3) the attention and feed-forward outputs are normed too before their residual adds. The
norm (RMSNorm, Gemma's (1 + w) RMSNorm, LayerNorm), the feed-forward block (SwiGLU/GeGLU, a plain
GELU MLP, routed experts), the attention extras, the embedding scale, the RoPE of each layer and
the final logit soft-capping are the family's parts. Parameter names follow Hugging Face's
checkpoints, so weights load by name.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.attention.backend import AttentionBackend
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.base import ModelSpec
from opentgi.models.families.attention import DecoderAttention
from opentgi.models.families.layout import DecoderLayout
from opentgi.models.layers.linear import (
    OneDNNLinear,
    RowTiledLinear,
    onednn_linear_usable,
    pack_linears,
    tile_linears,
)
from opentgi.models.layers.mlp import GatedMLP, PlainMLP
from opentgi.models.layers.moe import SparseMoE
from opentgi.models.layers.norm import make_norm
from opentgi.models.layers.rotary import RotaryEmbedding, local_rope_config
from opentgi.models.quantization.int4 import Int4Grid, Int4Switch, Int4Weight, int4_rows_worth_it

log = logging.getLogger(__name__)


def _feed_forward(config, layout: DecoderLayout, index: int) -> nn.Module:
    parts = layout.parts
    if layout.moe[index]:
        return SparseMoE(layout.hidden, layout.expert_intermediate, layout.num_experts, layout.top_k,
                         layout.renormalize, layout.act, parts.expert_names)
    if parts.mlp == "plain":
        return PlainMLP(layout.hidden, config.intermediate_size, layout.act, layout.mlp_bias)
    return GatedMLP(layout.hidden, config.intermediate_size, layout.act, layout.mlp_bias, parts.mlp_names)


class DecoderLayer(nn.Module):
    def __init__(self, config, layout: DecoderLayout, backend: AttentionBackend, index: int):
        super().__init__()
        parts = layout.parts
        self.mlp_attr = parts.mlp_attr
        self.self_attn = DecoderAttention(layout, backend, layout.windows[index])
        setattr(self, parts.mlp_attr, _feed_forward(config, layout, index))
        self.input_layernorm = make_norm(parts.norm, layout.hidden, layout.eps)
        self.post_attention_layernorm = make_norm(parts.norm, layout.hidden, layout.eps)
        self.sandwich = parts.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(parts.norm, layout.hidden, layout.eps)
            self.post_feedforward_layernorm = make_norm(parts.norm, layout.hidden, layout.eps)
        self.rope = 1 if layout.local_rope[index] else 0  # which of the model's RoPE tables

    @property
    def feed_forward(self) -> nn.Module:
        return getattr(self, self.mlp_attr)

    def forward(self, h, cos, sin, meta, kv_cache):
        if self.sandwich:
            h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, meta, *kv_cache)).add_(h)
            ff = self.feed_forward(self.pre_feedforward_layernorm(h))
            return self.post_feedforward_layernorm(ff).add_(h)
        h = self.self_attn(self.input_layernorm(h), cos, sin, meta, *kv_cache).add_(h)
        return self.feed_forward(self.post_attention_layernorm(h)).add_(h)


class DecoderModel(nn.Module):
    def __init__(self, config, layout: DecoderLayout, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, layout, backend, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = make_norm(layout.parts.norm, config.hidden_size, layout.eps)


# packed linear -> the checkpoint projections it holds, stacked in this order (either spelling)
_INT4_SOURCES = {
    ("self_attn", "qkv_proj"): (("q_proj", "k_proj", "v_proj"), ("qkv_proj",)),
    ("self_attn", "o_proj"): (("o_proj",),),
    ("mlp", "gate_up_proj"): (("gate_proj", "up_proj"), ("gate_up_proj",)),
    ("mlp", "down_proj"): (("down_proj",),),
}


class PagedDecoder(nn.Module):
    """A `PagedCausalLM` (models/base.py). `head` is "lm" (causal LM) or "score" (reward model)."""

    def __init__(self, config, spec: ModelSpec, backend: AttentionBackend, layout: DecoderLayout, head: str):
        super().__init__()
        self.config = config
        self.spec = spec
        self.layout = layout
        self.is_reward_model = head == "score"
        self.model = DecoderModel(config, layout, backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and head == "lm"
        if head == "score":
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        elif not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size ** 0.5 if layout.parts.embed_scale else None
        self.rotary: list[RotaryEmbedding] = []  # set by `materialize` (needs the real device)
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
            layer.feed_forward.fuse_projections()
        self.rotary = [RotaryEmbedding(self.config, self.spec.device)]
        if any(self.layout.local_rope):
            self.rotary.append(RotaryEmbedding(local_rope_config(self.config), self.spec.device))
        self._set_batch_invariant(batch_invariant)
        device = torch.device(self.spec.device)
        head_weight = None
        if not self.is_reward_model:
            head_weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        if onednn_linear_usable(device, self.spec.dtype):
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

    def _set_batch_invariant(self, wanted: bool) -> None:
        """Batch invariance is built and measured on the CPU path only (the torch attention
        backend; oneDNN linears, or row-tiled F.linear where oneDNN has no kernel), for dense
        feed-forward layers."""
        backend = self.model.layers[0].self_attn.backend if self.model.layers else None
        # routed experts multiply each expert's rows together: not made row-invariant
        experts = any(isinstance(layer.feed_forward, SparseMoE) for layer in self.model.layers)
        self.batch_invariant = (wanted and torch.device(self.spec.device).type == "cpu"
                                and getattr(backend, "name", None) == "torch" and not experts)
        if wanted and not self.batch_invariant:
            log.warning("batch invariance is built for the CPU path; this model runs without it "
                        "(docs/determinism.md)")
        if backend is not None:
            backend.batch_invariant = self.batch_invariant

    def _attach_int4(self, grids: dict[str, Int4Grid]) -> None:
        """Give each packed layer linear whose checkpoint weights all lie on a 4-bit grid its 4-bit
        copy, then keep them only if the kernel is measured faster here, and for which steps."""
        linears = []
        for i, layer in enumerate(self.model.layers):
            for (block, attr), spellings in _INT4_SOURCES.items():
                linear = getattr(getattr(layer, block, None), attr, None)
                for sources in spellings:
                    parts = [grids.get(f"model.layers.{i}.{block}.{source}.weight") for source in sources]
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
        if self.embed_scale is not None:  # in the model dtype, as Gemma's code rounds it
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        tables = [rotary.cos_sin(positions, h.dtype, attn.max_seqlen_k) for rotary in self.rotary]
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, *tables[layer.rope], attn, kv_cache)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.is_reward_model:
            raise TypeError("a reward model has no language-model head: use compute_score")
        if self.logits_proj is not None:
            logits = self.logits_proj(hidden).float()
        else:
            weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        cap = self.layout.final_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    @torch.inference_mode()
    def compute_score(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (each sequence's last token) -> float32 raw scores [N]."""
        if not self.is_reward_model:
            raise TypeError("only a reward (sequence-classification) model has compute_score")
        return self.score(hidden).float()[:, 0]
