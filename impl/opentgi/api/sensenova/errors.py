"""SenseNova's one error shape, `{"error": {"code", "message", "details"}}`, with gRPC-style codes:

    400  3   the body breaks the document (Connexion's validation): "invalid argument: ..."
    422  3   a well-formed request the server cannot serve (the handler's checks)
    401  16  a missing or wrong key
    429  8   too many requests in flight (--max-concurrent-requests)
    500  13  the generation failed
    503  14  the engine is unhealthy or the server shuts down

For the handler, the app's error mapper, auth and a stream's last event alike.
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
from opentgi.schemas import sensenova as schema

INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE, UNAUTHENTICATED = 3, 8, 13, 14, 16
PERMISSION_DENIED = 7
ERRORS = (  # engine error type -> (HTTP status, SenseNova code)
    (ValidationError, 422, INVALID_ARGUMENT),
    (OverloadedError, 429, RESOURCE_EXHAUSTED),
    (GenerationError, 500, INTERNAL),
    (UnhealthyError, 503, UNAVAILABLE),
)


def error_body(code: int, message: str) -> dict:
    return schema.ErrorResponse(error=schema.ErrorDetail(code=code, message=message, details=[])).model_dump(
        mode="json"
    )


def error_status_code(exc: BaseException) -> tuple[int, int]:
    """(HTTP status, SenseNova code) of an engine error."""
    if isinstance(exc, RequestSchemaError):  # the body breaks the document
        return 400, INVALID_ARGUMENT
    if isinstance(exc, StatusError):  # refused at the HTTP level (401, 413, 415, 404, 405)
        codes = {401: UNAUTHENTICATED, 403: PERMISSION_DENIED, 429: RESOURCE_EXHAUSTED}
        return exc.status, codes.get(exc.status, INVALID_ARGUMENT)
    for error_type, status, code in ERRORS:
        if isinstance(exc, error_type):
            return status, code
    return 500, INTERNAL


def sensenova_error(exc: BaseException) -> JSONError:
    status, code = error_status_code(exc)
    if isinstance(exc, RequestSchemaError):
        message = f"invalid argument: {exc.message}"
    elif isinstance(exc, OpenTGIError):
        message = exc.message
    else:
        message = f"Internal server error: {type(exc).__name__}"
    return JSONError(status, error_body(code, message), dict(getattr(exc, "headers", None) or {}))
