"""One decoder skeleton for every family of the paged path, built from the family's structure
(`families/structure.py`) and what its config says (`families/layout.py`), plus the one-label
sequence-classification (reward) head.

A layer is norm -> attention -> residual -> norm -> feed-forward -> residual; with sandwich norms
(Gemma 2/3) the attention and feed-forward outputs are normed too before their residual adds. The
norm (RMSNorm, Gemma's (1 + w) RMSNorm, LayerNorm), the feed-forward block (SwiGLU/GeGLU, a plain
GELU MLP, routed experts), the attention extras, the embedding scale, the RoPE of each layer and
the final logit soft-capping are the family's structure. Parameter names follow Hugging Face's
checkpoints, so weights load by name.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.attention.backend import AttentionBackend
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.torch_backend import prompt_form_invariant
from opentgi.models.base import ForwardWithoutHooks, ModelSpec
from opentgi.models.families.attention import DecoderAttention
from opentgi.models.families.layout import DecoderLayout
from opentgi.models.families.native_stack import NativeDecodeStack
from opentgi.models.layers.elementwise import elementwise_on_padded_copy
from opentgi.models.layers.linear import (
    OneDNNLinear,
    RowTiledLinear,
    onednn_linear_usable,
    pack_linears,
    tile_linears,
)
from opentgi.models.layers.mlp import GatedMLP, PlainMLP
from opentgi.models.layers.moe import SparseMoE
from opentgi.models.layers.norm import add_and_norm, make_norm, use_native
from opentgi.models.layers.rotary import MRotaryEmbedding, RotaryEmbedding, local_rope_config, mrope_section
from opentgi.models.quantization.gguf_blocks import native_dense_linear, repack_by_16_rows
from opentgi.models.quantization.prompt_copy import add_prompt_copies

log = logging.getLogger(__name__)


def _feed_forward(config, layout: DecoderLayout, index: int) -> nn.Module:
    structure = layout.structure
    if layout.moe[index]:
        return SparseMoE(layout.hidden, layout.expert_intermediate, layout.num_experts, layout.top_k,
                         layout.renormalize, layout.act, structure.expert_names)
    if structure.mlp == "plain":
        return PlainMLP(layout.hidden, config.intermediate_size, layout.act, layout.mlp_bias)
    return GatedMLP(layout.hidden, config.intermediate_size, layout.act, layout.mlp_bias, structure.mlp_names)


class DecoderLayer(ForwardWithoutHooks, nn.Module):
    def __init__(self, config, layout: DecoderLayout, backend: AttentionBackend, index: int):
        super().__init__()
        structure = layout.structure
        self.mlp_attr = structure.mlp_attr
        self.self_attn = DecoderAttention(layout, backend, layout.windows[index])
        setattr(self, structure.mlp_attr, _feed_forward(config, layout, index))
        self.input_layernorm = make_norm(structure.norm, layout.hidden, layout.eps)
        self.post_attention_layernorm = make_norm(structure.norm, layout.hidden, layout.eps)
        self.sandwich = structure.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(structure.norm, layout.hidden, layout.eps)
            self.post_feedforward_layernorm = make_norm(structure.norm, layout.hidden, layout.eps)
        self.rope = 1 if layout.local_rope[index] else 0  # which of the model's RoPE tables

    @property
    def feed_forward(self) -> nn.Module:
        return getattr(self, self.mlp_attr)

    def forward(self, h, cos, sin, meta, kv_cache):
        if self.sandwich:
            h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, meta, *kv_cache)).add_(h)
            ff = self.feed_forward(self.pre_feedforward_layernorm(h))
            return self.post_feedforward_layernorm(ff).add_(h)
        normed, h = add_and_norm(self.post_attention_layernorm,
                                 self.self_attn(self.input_layernorm(h), cos, sin, meta, *kv_cache), h)
        return self.feed_forward(normed).add_(h)


class DecoderModel(nn.Module):
    def __init__(self, config, layout: DecoderLayout, backend: AttentionBackend):
        super().__init__()
        # built on the meta device and loaded from the checkpoint: an empty weight skips the random
        # initialisation, whose first call on the meta device is slow
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList([DecoderLayer(config, layout, backend, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = make_norm(layout.structure.norm, config.hidden_size, layout.eps)


# A tied LM head gets its own copy in oneDNN's layout only up to this size: for a small model the
# copy saves a visible share of each step; for a larger one it would cost a large share of the
# resident weights for little of the step (docs/benchmarks.md). A larger one multiplies by the
# embedding itself: on the native dense rows where the kernels are loaded, else row-tiled F.linear.
TIED_HEAD_COPY_MAX_BYTES = 64 << 20


class PagedDecoder(nn.Module):
    """A `PagedCausalLM` (models/base.py). `head` is "lm" (causal LM), "score" (reward model; a
    pooling model's classification head: models/pooling/paged.py) or "none" (an embedding body:
    `forward`'s hidden states are its output)."""

    def __init__(self, config, spec: ModelSpec, backend: AttentionBackend, layout: DecoderLayout, head: str):
        super().__init__()
        self.config = config
        self.spec = spec
        self.layout = layout
        self.is_reward_model = head == "score"
        self.has_lm_head = head == "lm"
        self.model = DecoderModel(config, layout, backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and head == "lm"
        if head == "score":
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        elif head == "lm" and not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size ** 0.5 if layout.structure.embed_scale else None
        self.rotary: list[RotaryEmbedding] = []  # set by `materialize` (needs the real device)
        # the LM head in oneDNN's layout (CPU float32/bfloat16), or row-tiled (batch invariance)
        self.logits_proj: OneDNNLinear | RowTiledLinear | None = None
        self.batch_invariant = False  # set by `materialize`
        # some int4 layers multiply prompt rows through a dense copy (models/quantization/prompt_copy.py)
        self.kernels_by_row_kind = False
        # a tied head on the embedding's GGUF blocks (native kernels), set by the loader
        self.native_head: nn.Module | None = None
        # decode steps' layers in one native call, where they are of its shape (set by `materialize`)
        self.native_stack: NativeDecodeStack | None = None

    def materialize(self, batch_invariant: bool = False) -> None:
        """After the weights are loaded: fuse projections (quantized ones too, where their formats
        stack: models/quantization/linear.py), set up RoPE on the real device, and on CPU in
        float32 or bfloat16 run the dense linear layers through oneDNN (models/layers/linear.py).
        `batch_invariant`: linears and attention in the forms whose rows do not depend on the
        step's other rows (docs/determinism.md); quantized linears' kernels already are."""
        backend = self.model.layers[0].self_attn.backend if self.model.layers else None
        native_kernels = getattr(backend, "name", None) == "native"  # the native kernels are loaded
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            if native_kernels:  # before fusing: a mixture of experts moves dense experts onto them
                use_native(layer.feed_forward)
            layer.feed_forward.fuse_projections()
        section = mrope_section(self.config)
        self.rotary = [RotaryEmbedding(self.config, self.spec.device) if section is None
                       else MRotaryEmbedding(self.config, self.spec.device, section)]
        if any(self.layout.local_rope):
            self.rotary.append(RotaryEmbedding(local_rope_config(self.config), self.spec.device))
        self._set_batch_invariant(batch_invariant)
        device = torch.device(self.spec.device)
        head_weight = None
        if self.has_lm_head:
            tied = self.tie_word_embeddings
            embedding = getattr(self.model.embed_tokens, "weight", None)  # None: GGUF blocks (native)
            # a large tied head multiplies by the embedding itself rather than keep a packed copy
            copy_worth_it = not tied or (embedding is not None and
                                         embedding.numel() * embedding.element_size() <= TIED_HEAD_COPY_MAX_BYTES)
            if self.native_head is not None:
                self.logits_proj = self.native_head
            elif tied or isinstance(self.lm_head, nn.Linear):  # not a quantized head
                head_weight = embedding if tied else self.lm_head.weight
        if onednn_linear_usable(device, self.spec.dtype):
            pack_linears(self.model.layers, row_invariant=self.batch_invariant)
            held = add_prompt_copies(self.model.layers, self.spec.dtype, self.batch_invariant)
            self.kernels_by_row_kind = held > 0
            if head_weight is not None and copy_worth_it:
                self.logits_proj = OneDNNLinear(head_weight)
                if self.batch_invariant:
                    self.logits_proj.make_row_invariant(head_weight)
        elif self.batch_invariant:
            tile_linears(self.model.layers)
        if self.logits_proj is None and head_weight is not None and native_kernels:
            # (a tied head too large for a packed copy) the native dense rows on the weight's own
            # bytes: each output's sum in one fixed order, so row-invariant, and faster than the
            # row-tiled F.linear at every row count (docs/benchmarks.md)
            self.logits_proj = native_dense_linear(head_weight)
        if self.logits_proj is None and head_weight is not None and self.batch_invariant:
            self.logits_proj = RowTiledLinear(head_weight)  # shares the weight's storage
        if self.logits_proj is not None and not self.tie_word_embeddings:
            del self.lm_head
        if native_kernels:  # fused layer ops
            repacked = repack_by_16_rows(self.model.layers, self.spec.dtype)
            head = self.logits_proj if self.logits_proj is not None else getattr(self, "lm_head", None)
            if isinstance(head, nn.Module):  # a GGUF head (a tied one: the embedding's blocks)
                repacked += repack_by_16_rows(head, self.spec.dtype)
            if repacked:
                log.info("kernels: %.0f MiB of GGUF weights repacked by 16 rows", repacked / 2**20)
                for layer in self.model.layers:
                    if isinstance(layer.feed_forward, SparseMoE):
                        layer.feed_forward.group_experts()
            use_native(self)
            self.native_stack = NativeDecodeStack.build(self)
        if self.batch_invariant and hasattr(backend, "prompt_form"):  # prompt tokens' attention form
            spec = self.spec
            group = self.config.num_attention_heads // spec.num_kv_heads
            backend.prompt_form = prompt_form_invariant(spec.num_kv_heads, group, spec.head_dim, spec.dtype,
                                                        softcap=self.layout.attn_softcap)
            self.kernels_by_row_kind = self.kernels_by_row_kind or backend.prompt_form

    def _set_batch_invariant(self, wanted: bool) -> None:
        """Batch invariance is built and measured on the CPU path only (the torch attention
        backend; oneDNN linears, or row-tiled F.linear where oneDNN has no kernel; routed experts
        too: models/layers/moe.py)."""
        backend = self.model.layers[0].self_attn.backend if self.model.layers else None
        self.batch_invariant = (wanted and torch.device(self.spec.device).type == "cpu"
                                and getattr(backend, "name", None) in ("torch", "native"))
        if wanted and not self.batch_invariant:
            log.warning("batch invariance is built for the CPU path; this model runs without it "
                        "(docs/determinism.md)")
        if backend is not None:
            backend.batch_invariant = self.batch_invariant

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`image_embeds` (a vision-language model's prompt rows with images): (flat indices,
        rows) that replace those tokens' embeddings (models/vision/). `positions` int64 [T], or
        [3, T] with M-RoPE (layers/rotary.py)."""
        stack = self.native_stack if self.__dict__.get("lora") is None else None  # `lora`: a plain attribute
        if stack is not None and stack.embedding is not None and image_embeds is None:
            out = stack(input_ids, positions, attn, kv_caches)  # looks the ids up itself; the final norm's output
            if out is not None:
                return out
            stack = None  # not a step it takes
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:  # in the model dtype, as Gemma's code rounds it
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        if image_embeds is not None:  # after the scale, as transformers places them (Gemma 3)
            index, rows = image_embeds
            h = h.index_copy(0, index, rows.to(h.dtype))
        if stack is not None:
            out = stack(h, positions, attn, kv_caches)  # the final norm's output
            if out is not None:
                return out
        tables = [rotary.cos_sin(positions, h.dtype, attn.max_seqlen_k) for rotary in self.rotary]
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, *tables[layer.rope], attn, kv_cache)
        return self.model.norm(h)

    @torch.inference_mode()
    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], greedy: int = 0) -> torch.Tensor | None:
        """`compute_logits(forward(...))` of every row in one native call (the decode stack ending
        with the LM head: models/families/native_stack.py), or None where that call does not
        take the step (the caller runs `forward` and `compute_logits`). With `greedy` > 0, each
        row's greedy token instead (int64 [rows]): the first index of the largest of its first
        `greedy` logits, numpy's argmax of those logits."""
        stack = self.native_stack
        if stack is None or stack.head is None or self.__dict__.get("lora") is not None:
            return None
        logits = stack(input_ids, positions, attn, kv_caches, logits=True, greedy=greedy)
        return logits if logits is None or logits.dtype in (torch.float32, torch.int64) else logits.float()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.has_lm_head:
            raise TypeError("a reward or embedding model has no language-model head")
        if self.logits_proj is not None:
            logits = self.logits_proj(hidden)
        elif not self.tie_word_embeddings:
            logits = self.lm_head(hidden)  # nn.Linear, or a QuantizedLinear
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        cap = self.layout.final_softcap
        if cap is None:
            return logits if logits.dtype == torch.float32 else logits.float()
        # cap * tanh(x / cap) as 2 cap * sigmoid(2 x / cap) - cap: torch's CPU tanh is much slower
        # than sigmoid; the sigmoid on a padded copy (layers/elementwise.py), the float32 copy every
        # row needs anyway
        capped = elementwise_on_padded_copy(logits, lambda run: run.mul_(2 / cap).sigmoid_(), dtype=torch.float32)
        return capped.mul_(2 * cap).sub_(cap)

    @torch.inference_mode()
    def compute_score(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (each sequence's last token) -> float32 raw scores [N]."""
        if not self.is_reward_model:
            raise TypeError("only a reward (sequence-classification) model has compute_score")
        return self.score(hidden).float()[:, 0]
