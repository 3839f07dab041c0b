"""LoRA adapter selection as the dialects see it.

TGI's routes name an adapter in `parameters.adapter_id` (absent, null or the base model's id: the base
model; an unknown id: a 422 from the engine, naming the loaded adapters). Routes whose body names a
`model` (OpenAI's, SenseNova's) select the adapter of that name when one is loaded, and the base model
for anything else, as TGI and vLLM do.
"""

from __future__ import annotations

import time


def adapter_named_by_model(info, model: str | None) -> str | None:
    """The loaded adapter a request's `model` names, else None (the base model)."""
    return model if model is not None and model in info.adapters else None


def served_model_name(info, adapter_id: str | None) -> str:
    """What an answer's `model` field reports: the adapter that served it, or the base model."""
    return adapter_id or info.model_id


def models_list(info) -> dict:
    """OpenAI's `GET /v1/models`: the base model, then each loaded adapter (its parent: the base)."""
    created = int(time.time())
    base = {"id": info.model_id, "object": "model", "created": created, "owned_by": info.model_id,
            "model_kind": getattr(info, "model_kind", "generation")}
    adapters = [{"id": name, "object": "model", "created": created, "owned_by": info.model_id,
                 "parent": info.model_id} for name in info.adapters]
    return {"object": "list", "data": [base, *adapters]}
