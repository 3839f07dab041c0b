"""What sentence-transformers and transformers answer for the tiny pooling models, recomputed in
float64 with transformers' own classes, each input alone and unpadded (sentence-transformers is
not a dependency): the reference the served vectors and scores are checked against."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

COSINE_AT_LEAST = 0.99999
MAX_ABS_DIFF = 1e-4


def _pooling_of(folder: Path) -> tuple[str, bool]:
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    mode = next(m for flag, m in (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                                  ("pooling_mode_lasttoken", "lasttoken")) if config.get(flag))
    return mode, (folder / "2_Normalize").is_dir()


def reference_embeddings(folder: Path, texts: list[str], dimensions: int | None = None) -> list[list[float]]:
    """sentence-transformers' `encode(texts)` (then `truncate_dim` and normalization when
    `dimensions`), in float64."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float64).eval()
    mode, normalize = _pooling_of(folder)
    out = []
    with torch.no_grad():
        for text in texts:
            encoding = tokenizer(text, return_tensors="pt")
            if "token_type_ids" not in inspect.signature(model.forward).parameters:
                encoding.pop("token_type_ids", None)
            hidden = model(**encoding).last_hidden_state[0]
            vector = {"cls": hidden[0], "lasttoken": hidden[-1], "mean": hidden.mean(0)}[mode]
            if dimensions is not None:
                vector = vector[:dimensions]
            if normalize or dimensions is not None:
                vector = vector / vector.norm()
            out.append(vector.tolist())
    return out


def reference_logits(folder: Path, pairs: list[tuple[str, ...]]) -> list[list[float]]:
    """transformers' `*ForSequenceClassification` logits of each (text,) or (query, text), in float64."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return [model(**tokenizer(*pair, return_tensors="pt")).logits[0].tolist() for pair in pairs]


def assert_close(got: list[list[float]], expected: list[list[float]]) -> None:
    import torch

    for a, b in zip(got, expected, strict=True):
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        assert (a - b).abs().max().item() <= MAX_ABS_DIFF, (a, b)
        if a.numel() > 1:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() >= COSINE_AT_LEAST
