"""What every pooling route shares: the engine that answers (or the refusal naming what the served
model does), --max-client-batch-size, and the scores of logits."""

from __future__ import annotations

import base64
import math
import struct

from opentgi.api import runtime
from opentgi.engine.errors import ValidationError
from opentgi.engine.pooling import kinds


class EmptyInputError(ValidationError):
    """A request with nothing to compute (TEI: 400, error_type "Empty")."""


def pooling_engine(asked: str):
    """The served engine when its model answers `asked` ("embedding", "rerank", "classification");
    else `ModelKindError` naming what the model serves."""
    engine = runtime.engine()
    kinds.check(engine.info.model_id, getattr(engine.info, "model_kind", "generation"), asked)
    return engine


def check_batch_size(count: int) -> None:
    limit = runtime.settings().max_client_batch_size
    if count > limit:
        raise ValidationError(f"batch size {count} > maximum allowed batch size {limit}")


def check_dimensions(dimensions: int | None, engine) -> None:
    size = engine.info.embedding_dimension
    if dimensions is not None and not 0 < dimensions <= size:
        raise ValidationError(f"`dimensions` should be smaller than the maximum embedding dimension. "
                              f"Given: {dimensions}, the model's: {size}")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [v / total for v in exps]


def scores(logits: list[float], raw: bool) -> list[float]:
    """TEI's: the logits as they are with `raw`, else the sigmoid of one label's, the softmax of several."""
    if raw:
        return list(logits)
    return [sigmoid(logits[0])] if len(logits) == 1 else softmax(logits)


def base64_floats(vector: list[float]) -> str:
    """OpenAI's `base64` encoding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
