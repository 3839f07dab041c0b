"""What each kind of model serves, in the words refusals use (`ModelKindError`)."""

from __future__ import annotations

from opentgi.engine.errors import ModelKindError

SERVES = {
    "generation": "a text-generation model: it serves /generate, /v1/chat/completions and /v1/completions",
    "embedding": "an embedding model: it serves /v1/embeddings, /embed, /embed_all and /similarity",
    "rerank": "a reranker (cross-encoder): it serves /v1/rerank, /rerank and /predict",
    "classification": "a sequence classifier: it serves /predict",
}
ASKED = {"generation": "text generation", "embedding": "embeddings", "rerank": "reranking",
         "classification": "classification"}
# the kinds that can answer each pooling task
ANSWERS = {"embedding": ("embedding",), "rerank": ("rerank",), "classification": ("classification", "rerank")}


def refusal(model_id: str, served: str, asked: str) -> ModelKindError:
    return ModelKindError(f"model {model_id!r} is {SERVES.get(served, served)}; it does not serve "
                          f"{ASKED.get(asked, asked)}", served=served, asked=asked)


def check(model_id: str, served: str, asked: str) -> None:
    """Raise `ModelKindError` unless a model of kind `served` answers a request for `asked`."""
    if served not in ANSWERS.get(asked, (asked,)):
        raise refusal(model_id, served, asked)
