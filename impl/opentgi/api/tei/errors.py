"""TEI's error shape: `{"error": "...", "error_type": "..."}`, with TEI 1.9's statuses
(router/src/http/server.rs, `impl From<&ErrorType> for StatusCode`):

    Empty       400  nothing to compute ("`inputs` cannot be empty")
    Validation  422  a body that breaks the schema, an input past the model's maximum, a batch past
                     --max-client-batch-size (413 / 415 / 404 / 405 / 401 keep their status)
    Backend     424  the model does not serve the route ("Model is not an embedding model: ...")
    Overloaded  429  too many requests in flight
    Unhealthy   503  the engine stopped or failed
"""

from __future__ import annotations

import logging

from opentgi.api.embeddings.common import EmptyInputError
from opentgi.api.errors import JSONError, StatusError
from opentgi.engine.errors import (
    ModelKindError,
    OpenTGIError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)

log = logging.getLogger(__name__)

# TEI's own words for a route the model does not serve, before ours naming what it serves
NOT_SERVED = {"embedding": "Model is not an embedding model", "rerank": "model is not a re-ranker model",
              "classification": "Model is not a classifier model"}


def status_type(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, ModelKindError):
        return 424, "Backend"
    if isinstance(exc, EmptyInputError):
        return 400, "Empty"
    if isinstance(exc, ValidationError):
        return 422, "Validation"
    if isinstance(exc, StatusError):
        return exc.status, "Validation"
    if isinstance(exc, OverloadedError):
        return 429, "Overloaded"
    if isinstance(exc, UnhealthyError):
        return 503, "Unhealthy"
    log.error("unexpected error: %r", exc, exc_info=exc)
    return 424, "Backend"


def tei_error(exc: BaseException) -> JSONError:
    status, error_type = status_type(exc)
    if isinstance(exc, ModelKindError) and exc.asked in NOT_SERVED:
        message = f"{NOT_SERVED[exc.asked]}: {exc.message}"
    elif isinstance(exc, OpenTGIError):
        message = exc.message
    else:
        message = f"Inference failed: {type(exc).__name__}"
    return JSONError(status, {"error": message, "error_type": error_type},
                     dict(getattr(exc, "headers", None) or {}))
