"""A pooling model on transformers' modelling classes: a whole batch of inputs in one forward pass,
no KV cache, then pooling (embedding) or the classification head (rerank, classification). The
encoders run here; decoders of the paged path's families run on its model code (paged.py).

**Batches**: inputs are padded (right, masked) to a length bucket, a multiple of `BUCKET` tokens,
and each bucket runs as one batch, so inputs of different lengths share a forward pass.

**Invariance** (as the paged path's, docs/determinism.md): an input's numbers do not depend on the
other inputs of its batch. Its padded length depends on its own length only, and it always gets at
least one pad token, so every batch carries a mask and attention always takes its masked form
(transformers drops an all-ones mask: alone, an input would meet another attention call); one at
the model's maximum runs unpadded, only with inputs of its exact length. Every linear is in a
row-invariant form (models/layers/linear.py: oneDNN's packed linear in its probed form, else row
tiles), attention and the norms work per sequence and per row, and pooling per input.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from opentgi.models.layers.linear import onednn_linear_usable, pack_linears, tile_linears
from opentgi.models.pooling.folder import PoolingFolder, PoolingFolderError

log = logging.getLogger(__name__)

BUCKET = 16  # padded lengths are multiples of this many tokens


@dataclass(frozen=True)
class PoolingInput:
    """One input as the model takes it: token ids and, for a BERT pair, their token type ids."""

    ids: list[int]
    type_ids: list[int] | None = None


class PoolingModel:
    """`run(inputs)` -> one float32 tensor per input: the pooled vector (embedding) or the head's
    logits (rerank, classification)."""

    def __init__(self, model, folder: PoolingFolder, max_length: int, device: torch.device,
                 max_batch_tokens: int = 16384, pad_token_id: int = 0):
        self.model = model
        self.pad_token_id = pad_token_id
        self.folder = folder
        self.max_batch_tokens = max_batch_tokens  # one forward pass takes at most this many tokens
        self.max_length = max_length
        self.device = device
        config = model.config
        self.hidden_size = int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0))
        # a decoder classifier (Qwen3/Llama ...ForSequenceClassification) scores its last token: run
        # its body and its `score` head on the last token here (transformers' own looks for padding)
        self.decoder_head = getattr(model, "score", None) if folder.kind != "embedding" else None
        body = model.base_model if self.decoder_head is not None else model
        self.takes_token_types = "token_type_ids" in inspect.signature(body.forward).parameters

    @property
    def kind(self) -> str:
        return self.folder.kind

    @torch.inference_mode()
    def run(self, inputs: list[PoolingInput], all_tokens: bool = False) -> list[torch.Tensor]:
        """`all_tokens` (an embedding model): each input's token vectors [n, hidden], not pooled."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, item in enumerate(inputs):
            groups.setdefault(self.padded_length(len(item.ids)), []).append(i)
        for (length, padded), members in sorted(groups.items()):
            step = max(1, self.max_batch_tokens // max(length, 1))
            for start in range(0, len(members), step):
                chunk = members[start:start + step]
                for i, row in zip(chunk, self._forward([inputs[i] for i in chunk], length, all_tokens), strict=True):
                    out[i] = row
        return out

    def padded_length(self, n: int) -> tuple[int, bool]:
        """(the length an input of `n` tokens runs at, whether that is padded): the next multiple of
        `BUCKET` past n, at least one pad, up to the model's maximum; else n, unpadded."""
        length = (n // BUCKET + 1) * BUCKET
        return (length, True) if length <= self.max_length else (n, False)

    def _forward(self, inputs: list[PoolingInput], length: int, all_tokens: bool = False) -> list[torch.Tensor]:
        """Inputs of at most `length` tokens, padded to it on the right, as one batch."""
        batch = len(inputs)
        ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, length), dtype=torch.long)
        types = torch.zeros((batch, length), dtype=torch.long)
        lengths = [len(item.ids) for item in inputs]
        for row, item in enumerate(inputs):
            ids[row, :lengths[row]] = torch.tensor(item.ids, dtype=torch.long)
            mask[row, :lengths[row]] = 1
            if item.type_ids is not None:
                types[row, :lengths[row]] = torch.tensor(item.type_ids, dtype=torch.long)
        kwargs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self.takes_token_types and any(item.type_ids is not None for item in inputs):
            kwargs["token_type_ids"] = types.to(self.device)
        if self.folder.kind == "embedding":
            hidden = self.model(**kwargs).last_hidden_state
            mode = "none" if all_tokens else self.folder.pooling
            return [pool(hidden[row, :n], mode) for row, n in enumerate(lengths)]
        if self.decoder_head is not None:
            hidden = self.model.base_model(**kwargs).last_hidden_state
            return [self.decoder_head(hidden[row, n - 1:n]).float()[0] for row, n in enumerate(lengths)]
        logits = self.model(**kwargs).logits
        return [logits[row].float() for row in range(batch)]


def pool(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """One input's token vectors [n, hidden] -> its vector, in float32 (mode "none": the token
    vectors themselves)."""
    hidden = hidden.float()
    if mode == "none":
        return hidden.clone()
    if mode == "cls":
        return hidden[0].clone()
    if mode == "lasttoken":
        return hidden[-1].clone()
    if mode == "max":
        return hidden.max(dim=0).values
    return hidden.sum(dim=0) / hidden.shape[0]


def max_length_of(model_config, tokenizer, folder: PoolingFolder, limit: int | None) -> int:
    """The most tokens an input may have: the least of the model's positions (less RoBERTa's
    padding offset), the tokenizer's and sentence-transformers' limits and --max-input-tokens."""
    positions = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    if positions and getattr(model_config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        positions -= int(getattr(model_config, "pad_token_id", 1) or 1) + 1
    candidates = [positions or None, folder.max_seq_length, limit]
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and model_max < 1_000_000:
        candidates.append(model_max)
    found = [int(c) for c in candidates if c]
    return min(found) if found else 512


def load_pooling_model(folder: PoolingFolder, tokenizer, dtype: torch.dtype, device: torch.device, *,
                       max_input_tokens: int | None = None, batch_invariant: bool = True,
                       trust_remote_code: bool = False) -> PoolingModel:
    from transformers import AutoModel, AutoModelForSequenceClassification

    loader = AutoModel if folder.kind == "embedding" else AutoModelForSequenceClassification
    try:
        model = loader.from_pretrained(folder.body, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise PoolingFolderError(f"transformers cannot load {folder.body} as a {folder.kind} model: {exc}") from None
    model = model.to(device).eval()
    if device.type == "cpu":
        if onednn_linear_usable(device, dtype):
            pack_linears(model, row_invariant=batch_invariant)
        elif batch_invariant:
            tile_linears(model)
    max_length = max_length_of(model.config, tokenizer, folder, max_input_tokens)
    log.info("%s: %s model (%s), at most %d tokens an input", folder.architecture, folder.kind,
             folder.pooling or f"{len(folder.id2label)} labels", max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else getattr(model.config, "pad_token_id", None)
    return PoolingModel(model, folder, max_length, device, pad_token_id=int(pad or 0))
