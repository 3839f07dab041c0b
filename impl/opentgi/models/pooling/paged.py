"""A decoder pooling model on the paged path's model code (models/families/): the embedding bodies
of Qwen3-Embedding and gte-Qwen2 (last-token pooling, or any other mode) and decoder
`*ForSequenceClassification` cross-encoders and classifiers (their `score` head on each input's
last token), built by `build_paged_model` with a pooling head ("none" or "score").

**Batches**: a pass packs its inputs one after another in one flat batch, unpadded, as the
generation engine packs fresh prompts. Nothing is decoded after a pass, so there is no KV cache:
attention (`WholeSequenceAttention`, the model's backend) attends each input's queries to its own
keys and values as the layer computed them, one causal `scaled_dot_product_attention` call an
input. Inputs go into a pass in order until `max_batch_tokens`; a longer one runs alone.

**Invariance** (docs/determinism.md): the linears are in the paged path's row-invariant forms,
norms and RoPE work per row, and attention, pooling and the head per input, each in a call whose
shape is the input's own; so an input's numbers do not depend on the other inputs of its pass nor
on where it lies in it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.softcap import softcapped_attention
from opentgi.models.pooling.folder import PoolingFolder
from opentgi.models.pooling.model import pool

log = logging.getLogger(__name__)

# each kind's head on the paged decoder: none (the hidden states are pooled) or the classification
# `score`. Bodies of the families the paged path has (registry.py FAMILIES, by model_type) run
# here; any other runs on transformers' classes (models/pooling/model.py)
HEADS = {"embedding": "none", "rerank": "score", "classification": "score"}


def paged_body_config(folder: PoolingFolder, trust_remote_code: bool = False):
    """The transformers config of `folder`'s body when the paged path serves it, else None."""
    from transformers import AutoConfig

    from opentgi.models.registry import paged_unsupported_reason

    try:
        config = AutoConfig.from_pretrained(folder.body, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    if getattr(config, "is_encoder_decoder", False) or paged_unsupported_reason(config, HEADS[folder.kind]):
        return None
    return config


def _body_name(name: str) -> str | None:
    """A checkpoint tensor's name in the paged decoder: a bare body's (`Qwen3Model`: `layers.*`)
    under `model.`; a causal LM's head is not loaded."""
    if name.startswith("lm_head."):
        return None
    if name.startswith(("model.", "score.")):
        return name
    return "model." + name


class WholeSequenceAttention:
    """The attention backend of a pooling pass (module docstring): every sequence of the pass is
    a whole input, attended causally over its own keys; the caches are not used. Named "torch":
    the CPU torch forms, with which the model takes its row-invariant linears (decoder.py)."""

    name = "torch"
    batch_invariant = False  # set by the model; this backend's form is invariant either way

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        cu = meta.scratch.get("cu")
        if cu is None:
            cu = meta.scratch["cu"] = meta.cu_seqlens_q.tolist()
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            q_s, k_s, v_s = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, n, D]
            mask = None
            if sliding_window is not None and sliding_window < end - start:
                pos = torch.arange(end - start, device=q.device)
                mask = (pos.unsqueeze(0) <= pos.unsqueeze(1)) & (pos.unsqueeze(0) > pos.unsqueeze(1) - sliding_window)
            if softcap is not None:
                if group > 1:
                    k_s, v_s = k_s.repeat_interleave(group, dim=1), v_s.repeat_interleave(group, dim=1)
                if mask is None:
                    mask = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril_()
                o = softcapped_attention(q_s, k_s, v_s, mask, scale, softcap)
            else:
                o = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, is_causal=mask is None,
                                                   scale=scale, enable_gqa=group > 1)
            out[start:end] = o.squeeze(0).transpose(0, 1)
        return out


class PagedPoolingModel:
    """`run(inputs)` -> one float32 tensor per input, as models/pooling/model.py's PoolingModel."""

    def __init__(self, model, folder: PoolingFolder, max_length: int, device: torch.device,
                 max_batch_tokens: int = 16384):
        self.model = model  # a PagedDecoder with head "none" or "score", on WholeSequenceAttention
        self.folder = folder
        self.max_length = max_length
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.hidden_size = int(model.config.hidden_size)

    @property
    def kind(self) -> str:
        return self.folder.kind

    @torch.inference_mode()
    def run(self, inputs, all_tokens: bool = False) -> list[torch.Tensor]:
        """`all_tokens` (an embedding model): each input's token vectors [n, hidden], not pooled."""
        out: list[torch.Tensor] = []
        start = 0
        while start < len(inputs):
            end, tokens = start, 0
            while end < len(inputs) and (end == start or tokens + len(inputs[end].ids) <= self.max_batch_tokens):
                tokens += len(inputs[end].ids)
                end += 1
            out += self._forward([item.ids for item in inputs[start:end]], "none" if all_tokens else self.folder.pooling)
            start = end
        return out

    def _forward(self, sequences: list[list[int]], mode: str | None) -> list[torch.Tensor]:
        device = self.device
        lengths = [len(ids) for ids in sequences]
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        no_cache = torch.empty(0, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=no_cache.long(), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths), context_lens=torch.tensor(lengths, dtype=torch.int32),
            block_tables=no_cache, decode_only=False)
        ids = torch.tensor([t for ids in sequences for t in ids], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        hidden = self.model(ids, positions, meta, [(None, None)] * self.model.spec.num_layers)
        ends = cu[1:].tolist()
        if self.folder.kind != "embedding":  # the head on each input's last token, one row at a time
            return [self.model.score(hidden[end - 1:end]).float()[0] for end in ends]
        return [pool(hidden[end - n:end], mode) for end, n in zip(ends, lengths, strict=True)]


def load_paged_pooling_model(folder: PoolingFolder, config, dtype: torch.dtype, device: torch.device, *,
                             max_length: int, batch_invariant: bool = True) -> PagedPoolingModel:
    from opentgi.models.checkpoints.loading import FolderWeights
    from opentgi.models.registry import build_paged_model

    weights = FolderWeights(folder.body, config)
    weights.rename = _body_name
    model = build_paged_model(weights, config, WholeSequenceAttention(), dtype, device,
                              batch_invariant=batch_invariant, pooling_head=HEADS[folder.kind])
    if folder.kind != "embedding" and model.score.out_features != len(folder.id2label):
        raise ValueError(f"{folder.body}: a score head of {model.score.out_features} labels, id2label has "
                         f"{len(folder.id2label)}")
    log.info("%s: %s model on the paged decoder (%s), at most %d tokens an input", folder.architecture,
             folder.kind, folder.pooling or f"{len(folder.id2label)} labels", max_length)
    return PagedPoolingModel(model, folder, max_length, device)
