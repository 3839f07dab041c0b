"""TGI's error shape: every error a client can see, mapped once to TGI's status code and body.

Body: `{"error": "...", "error_type": "..."}`, as TGI 2.1's router writes it (`server.rs`,
`impl From<InferError> for (StatusCode, Json<ErrorResponse>)`):

    validation            422  "Input validation error: <reason>"
    template_error        422  "Template error: <reason>"
    tool_error            422  "Tool error: <reason>"
    generation            424  "Request failed during generation: <reason>"
    overloaded            429  "Model is overloaded"
    incomplete_generation 500  "Incomplete generation"
    healthcheck           503  "unhealthy"

Connexion's request-validation failures (typed by `body_validation`) get TGI's answer too: a field
TGI itself checks gets TGI's message for it; any other schema failure gets axum's deserialization
message, a body that is not JSON axum's parse message (both 422: axum says 400 for the
latter, but TGI's document has 422 for bad input), a wrong content type 415.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from connexion.exceptions import BadRequestProblem, ProblemException, UnsupportedMediaTypeProblem
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from opentgi.api.body_validation import BodyParseError, BodySchemaError
from opentgi.engine import errors as engine_errors

log = logging.getLogger(__name__)

VALIDATION_PREFIX = "Input validation error: "
DESERIALIZE_PREFIX = "Failed to deserialize the JSON body into the target type: "
PARSE_PREFIX = "Failed to parse the request body as JSON: "
RANGE_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "maxItems",
                            "minItems"})
# TGI 2.1's checks in its order (validation.rs `validate`; `validate_best_of` runs before it).
TGI_CHECK_ORDER = ("best_of", "temperature", "repetition_penalty", "frequency_penalty", "top_p", "typical_p",
                   "top_k", "max_new_tokens", "stop", "top_n_tokens", "truncate")
# Parameters TGI reads as unsigned Rust integers: a negative value fails deserialization, before any check.
UNSIGNED_PARAMETERS = {"best_of": "usize", "max_new_tokens": "u32", "seed": "u64", "top_n_tokens": "u32",
                       "truncate": "usize"}


@dataclass(frozen=True)
class ErrorReply:
    status: int
    error: str
    error_type: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def body(self) -> dict[str, str]:
        return {"error": self.error, "error_type": self.error_type}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers or None)


@dataclass(frozen=True)
class JSONError:
    """A dialect's error answer (LightLLM, SenseNova): status, JSON body (compact, non-ASCII kept)."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers or None)


class StatusError(engine_errors.OpenTGIError):
    """A refusal at the HTTP level, before any handler, with its own status (413, 415, 404, 405);
    every dialect answers it with that status in its own shape."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


class PayloadTooLargeError(StatusError):
    """The request body is larger than --payload-limit (TGI, axum: 413)."""

    def __init__(self, limit: int):
        super().__init__(413, f"Failed to buffer the request body: length limit exceeded (the limit is {limit} "
                              f"bytes, --payload-limit)")
        self.limit = limit


class UnsupportedMediaTypeError(StatusError):
    """A body without `Content-Type: application/json` (axum: 415)."""

    def __init__(self):
        super().__init__(415, "Expected request with `Content-Type: application/json`")


class ShuttingDownError(engine_errors.UnhealthyError):
    """The server is shutting down: no new requests, and those still running at the end of
    --shutdown-timeout end with this (503 in every dialect)."""


class UnauthorizedError(StatusError):
    """A missing or wrong bearer token (--api-key): 401 with `WWW-Authenticate: Bearer`."""

    def __init__(self, message: str = "Unauthorized: missing or invalid bearer token"):
        super().__init__(401, message, {"WWW-Authenticate": "Bearer"})


class ForbiddenError(StatusError):
    """A tenant's key on a route only an admin tenant may call (--tenants): 403."""

    def __init__(self, message: str = "Forbidden: this route needs an admin key"):
        super().__init__(403, message)


class RequestSchemaError(engine_errors.ValidationError):
    """The body breaks the dialect's document (Connexion's validation), for the dialects with their own
    error shape: LightLLM and SenseNova answer it 400 where their handlers' refusals are 422."""


class DeserializationError(engine_errors.ValidationError):
    """The body does not fit TGI's Rust types (serde's error: axum refuses it before TGI's handler
    runs, so it is never an in-stream event nor counted): 422 with axum's prefix."""


class IncompleteGenerationError(engine_errors.OpenTGIError):
    """The engine's stream ended without a final event (TGI: 500 "Incomplete generation")."""

    def __init__(self, message: str = "Incomplete generation"):
        super().__init__(message)


@dataclass(frozen=True)
class FieldLimits:
    """The limits TGI's messages quote (Settings + the engine's derived token limits)."""

    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int = 1024


def tgi_error(exc: BaseException, limits: FieldLimits | None = None) -> ErrorReply:
    """The one mapping from an exception to TGI's status code and body."""
    if isinstance(exc, engine_errors.TemplateError):
        return ErrorReply(422, f"Template error: {exc.message}", "template_error")
    if getattr(exc, "error_type", None) == "tool_error":  # opentgi.api.chat.tools.ToolError (OpenAI chat)
        return ErrorReply(422, f"Tool error: {exc.message}", "tool_error")
    if isinstance(exc, DeserializationError):
        return ErrorReply(422, DESERIALIZE_PREFIX + exc.message, "validation")
    if isinstance(exc, engine_errors.ValidationError):
        return ErrorReply(422, VALIDATION_PREFIX + exc.message, "validation")
    if isinstance(exc, engine_errors.OverloadedError):
        return ErrorReply(429, "Model is overloaded", "overloaded")
    if isinstance(exc, engine_errors.GenerationError):
        return ErrorReply(424, f"Request failed during generation: {exc.message}", "generation")
    if isinstance(exc, engine_errors.UnhealthyError):
        return ErrorReply(503, f"unhealthy: {exc.message}", "healthcheck")
    if isinstance(exc, StatusError):
        error_type = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                      429: "overloaded"}.get(exc.status, "validation")
        return ErrorReply(exc.status, exc.message, error_type, exc.headers)
    if isinstance(exc, IncompleteGenerationError):
        return ErrorReply(500, "Incomplete generation", "incomplete_generation")
    if isinstance(exc, ProblemException | HTTPException):
        return request_error(exc, limits or FieldLimits())
    log.error("unexpected error: %r", exc, exc_info=exc)
    return ErrorReply(500, f"Internal server error: {type(exc).__name__}", "internal_error")


def request_error(exc: ProblemException | HTTPException, limits: FieldLimits) -> ErrorReply:
    """Connexion's and Starlette's own errors (validation, routing) in TGI's shape."""
    if isinstance(exc, BodySchemaError):
        return body_schema_reply(exc, limits)
    if isinstance(exc, BodyParseError):  # axum says 400; TGI's document gives 422 for bad input
        return ErrorReply(422, (DESERIALIZE_PREFIX if exc.empty else PARSE_PREFIX) + exc.reason, "validation")
    if isinstance(exc, UnsupportedMediaTypeProblem):
        return ErrorReply(415, "Expected request with `Content-Type: application/json`", "validation")
    if isinstance(exc, BadRequestProblem):
        if exc.detail == "RequestBody is required":
            return ErrorReply(422, DESERIALIZE_PREFIX + "EOF while parsing a value at line 1 column 0",
                              "validation")
        return ErrorReply(422, VALIDATION_PREFIX + str(exc.detail), "validation")
    status = getattr(exc, "status_code", None) or getattr(exc, "status", 500)
    headers = dict(getattr(exc, "headers", None) or {})
    if status == 404:
        return ErrorReply(404, "Not Found", "not_found", headers)
    if status == 405:
        return ErrorReply(405, "Method Not Allowed", "method_not_allowed", headers)
    detail = getattr(exc, "detail", None) or getattr(exc, "title", None) or "error"
    return ErrorReply(status, str(detail), "validation" if 400 <= status < 500 else "internal_error", headers)


def body_schema_reply(exc: BodySchemaError, limits: FieldLimits) -> ErrorReply:
    """What TGI answers a body with these schema failures: serde's deserialization error when there is
    one (a wrong type, a missing field, a negative unsigned integer), else the failed check that
    comes first in TGI's order, with TGI's message."""
    checks = []
    for error in exc.all_errors:
        message = tgi_field_message(error, limits)
        if message is None:
            return ErrorReply(422, DESERIALIZE_PREFIX + schema_error_text(error), "validation")
        checks.append((TGI_CHECK_ORDER.index(error.path[1]), message))
    return ErrorReply(422, VALIDATION_PREFIX + min(checks)[1], "validation")


def negative_unsigned(exc: BodySchemaError) -> str | None:
    """The Rust type of a TGI parameter given a negative value it cannot hold, else None."""
    if len(exc.path) != 2 or exc.path[0] != "parameters" or exc.keyword not in RANGE_KEYWORDS:
        return None
    value = exc.instance
    if isinstance(value, bool) or not isinstance(value, int | float) or value >= 0:
        return None
    return UNSIGNED_PARAMETERS.get(exc.path[1])


def schema_error_text(exc: BodySchemaError) -> str:
    rust_type = negative_unsigned(exc)
    if rust_type is not None:  # serde: `-1` into a u32
        kind = "integer" if isinstance(exc.instance, int) else "floating point"
        return f"{exc.field}: invalid value: {kind} `{exc.instance}`, expected {rust_type}"
    return f"{exc.field}: {exc.message}" if exc.path and not exc.message.startswith("missing field") \
        else exc.message


def tgi_field_message(exc: BodySchemaError, limits: FieldLimits) -> str | None:
    """TGI's own message for a range failure on a parameter TGI validates itself, else None."""
    if len(exc.path) != 2 or exc.path[0] != "parameters" or exc.keyword not in RANGE_KEYWORDS:
        return None
    if negative_unsigned(exc) is not None:
        return None
    name, value = exc.path[1], exc.instance
    messages = {
        "temperature": "`temperature` must be strictly positive",
        "repetition_penalty": "`repetition_penalty` must be strictly positive",
        "frequency_penalty": "`frequency_penalty` must be >= -2.0 and <= 2.0",
        "top_p": "`top_p` must be > 0.0 and < 1.0",
        "typical_p": "`typical_p` must be > 0.0 and < 1.0",
        "top_k": "`top_k` must be strictly positive",
        "max_new_tokens": "`max_new_tokens` must be strictly positive",
        "best_of": f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {value}",
        "top_n_tokens": f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {value}",
        "truncate": f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
                    f"Given: {value}",
    }
    if name == "stop" and isinstance(value, list):
        return f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(value)}"
    return messages.get(name)
