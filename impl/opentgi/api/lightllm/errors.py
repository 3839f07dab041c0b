"""LightLLM's one error shape, `{"message": ...}`, with its status codes:

    400  the body breaks the document (Connexion's validation)
    422  a well-formed request the server cannot serve (the handlers' checks)
    429  too many requests in flight (--max-concurrent-requests)
    500  the generation failed
    503  the engine is unhealthy or the server shuts down
    its own status for a refusal at the HTTP level (401, 404, 405, 413, 415)

For handlers, the app's error mapper, auth and a stream's last event alike.
"""

from __future__ import annotations

from opentgi.api.errors import JSONError, RequestSchemaError, StatusError
from opentgi.engine.errors import (
    GenerationError,
    OpenTGIError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)

ERROR_STATUS = (
    (ValidationError, 422),
    (OverloadedError, 429),
    (GenerationError, 500),
    (UnhealthyError, 503),
)


def error_status(exc: BaseException) -> int:
    if isinstance(exc, RequestSchemaError):  # the body breaks the document
        return 400
    if isinstance(exc, StatusError):  # refused at the HTTP level (413, 415, 404, 405)
        return exc.status
    for error_type, status in ERROR_STATUS:
        if isinstance(exc, error_type):
            return status
    return 500


def lightllm_error(exc: BaseException) -> JSONError:
    message = exc.message if isinstance(exc, OpenTGIError) else f"Internal server error: {type(exc).__name__}"
    return JSONError(error_status(exc), {"message": message}, dict(getattr(exc, "headers", None) or {}))
