"""OpenAI's one error shape: `{"error": {"message", "type", "param", "code"}}`, with OpenAI's statuses:

    invalid_request_error   400  the body breaks the document or the API's rules
    authentication_error    401  a missing or wrong key (code "invalid_api_key")
    not_found_error         404  no stored response has the id, or no such path
    invalid_request_error   413  a body past --payload-limit; 415 without a JSON content type
    rate_limit_error        429  too many requests in flight (--max-concurrent-requests)
    server_error            500  the server failed; 503 while it shuts down

In a stream that fails after opening, the last event is OpenAI's `error` event:
`{"type": "error", "code", "message", "param", "sequence_number"}`.
"""

from __future__ import annotations

import logging

from opentgi.api.errors import IncompleteGenerationError, JSONError, StatusError
from opentgi.api.sse import NamedEvent
from opentgi.engine.errors import (
    GenerationError,
    InputTooLongError,
    OpenTGIError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)

log = logging.getLogger(__name__)


class ResponseNotFoundError(StatusError):
    """No stored response has this id (never stored, deleted, or evicted)."""

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(404, f"Response with id '{response_id}' not found.")
        self.param = param


def status_type_code(exc: BaseException) -> tuple[int, str, str | None]:
    if isinstance(exc, InputTooLongError):
        return 400, "invalid_request_error", "context_length_exceeded"
    if isinstance(exc, ValidationError):
        return 400, "invalid_request_error", None
    if isinstance(exc, StatusError):
        if exc.status == 401:
            return 401, "authentication_error", "invalid_api_key"
        if exc.status == 404:
            return 404, "not_found_error", None
        if exc.status == 403:
            return 403, "permission_error", None
        if exc.status == 429:
            return 429, "rate_limit_error", "rate_limit_exceeded"
        return exc.status, "invalid_request_error", None
    if isinstance(exc, OverloadedError):
        return 429, "rate_limit_error", "rate_limit_exceeded"
    if isinstance(exc, UnhealthyError):
        return 503, "server_error", None
    if isinstance(exc, GenerationError | IncompleteGenerationError):
        return 500, "server_error", None
    log.error("unexpected error: %r", exc, exc_info=exc)
    return 500, "server_error", None


def openai_error(exc: BaseException) -> JSONError:
    status, error_type, code = status_type_code(exc)
    message = exc.message if isinstance(exc, OpenTGIError) else f"Internal server error: {type(exc).__name__}"
    body = {"error": {"message": message, "type": error_type, "param": getattr(exc, "param", None), "code": code}}
    return JSONError(status, body, dict(getattr(exc, "headers", None) or {}))


def error_event(exc: BaseException, generation=None) -> NamedEvent:
    """A stream's last event when it fails after opening, numbered after the events already sent."""
    error = openai_error(exc).body["error"]
    sequence = next(generation.context.sequence) if generation is not None and generation.context else 0
    return NamedEvent("error", {"type": "error", "code": error["code"], "message": error["message"],
                                "param": error["param"], "sequence_number": sequence})
