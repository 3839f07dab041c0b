"""Anthropic's one error shape: `{"type": "error", "error": {"type": ..., "message": ...}}`, with
Anthropic's status codes (https://docs.anthropic.com/en/api/errors):

    invalid_request_error   400  the body breaks the document or the API's rules (prompt too long too)
    authentication_error    401  a missing or wrong key (x-api-key or bearer)
    not_found_error         404  no such path
    request_too_large       413  a body past --payload-limit
    api_error               500  the server failed; 503 while it shuts down
    overloaded_error        529  too many requests in flight (--max-concurrent-requests)

For handlers, the app's error mapper, auth and a stream's last event (`event: error`) alike.
"""

from __future__ import annotations

import logging

from opentgi.api.errors import IncompleteGenerationError, JSONError, StatusError
from opentgi.api.sse import NamedEvent
from opentgi.engine.errors import (
    GenerationError,
    OpenTGIError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)

log = logging.getLogger(__name__)

OVERLOADED = 529  # Anthropic's status for "overloaded"
STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error"}


def status_and_type(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, ValidationError):
        return 400, "invalid_request_error"
    if isinstance(exc, StatusError):
        return exc.status, STATUS_TYPES.get(exc.status, "invalid_request_error")
    if isinstance(exc, OverloadedError):
        return OVERLOADED, "overloaded_error"
    if isinstance(exc, UnhealthyError):
        return 503, "api_error"
    if isinstance(exc, GenerationError | IncompleteGenerationError):
        return 500, "api_error"
    log.error("unexpected error: %r", exc, exc_info=exc)
    return 500, "api_error"


def anthropic_error(exc: BaseException) -> JSONError:
    status, error_type = status_and_type(exc)
    message = exc.message if isinstance(exc, OpenTGIError) else f"Internal server error: {type(exc).__name__}"
    return JSONError(status, {"type": "error", "error": {"type": error_type, "message": message}},
                     dict(getattr(exc, "headers", None) or {}))


def error_event(exc: BaseException, _generation=None) -> NamedEvent:
    """A stream's last event when it fails after opening."""
    return NamedEvent("error", anthropic_error(exc).body)
