"""The TGI error mapping: each typed error, and Connexion's request failures, to TGI's status and body."""

from __future__ import annotations

import json

import pytest
from connexion.exceptions import BadRequestProblem, UnsupportedMediaTypeProblem
from starlette.exceptions import HTTPException

from opentgi.api.body_validation import BodyParseError, BodySchemaError, TypedJSONBodyValidator
from opentgi.api.errors import FieldLimits, IncompleteGenerationError, tgi_error
from opentgi.engine import errors

LIMITS = FieldLimits(max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=1024)


@pytest.mark.parametrize(("exc", "status", "body"), [
    (errors.ValidationError("`temperature` must be strictly positive"), 422,
     {"error": "Input validation error: `temperature` must be strictly positive", "error_type": "validation"}),
    (errors.InputTooLongError("too long", input_tokens=5, max_new_tokens=1, limit=4), 422,
     {"error": "Input validation error: too long", "error_type": "validation"}),
    (errors.GrammarError("bad regex"), 422, {"error": "Input validation error: bad regex",
                                            "error_type": "validation"}),
    (errors.NotSupportedError("grammar is not supported"), 422,
     {"error": "Input validation error: grammar is not supported", "error_type": "validation"}),
    (errors.TemplateError("unknown role"), 422, {"error": "Template error: unknown role",
                                                 "error_type": "template_error"}),
    (errors.OverloadedError("whatever"), 429, {"error": "Model is overloaded", "error_type": "overloaded"}),
    (errors.GenerationError("OOM"), 424, {"error": "Request failed during generation: OOM",
                                          "error_type": "generation"}),
    (errors.UnhealthyError("stalled"), 503, {"error": "unhealthy: stalled", "error_type": "healthcheck"}),
    (IncompleteGenerationError(), 500, {"error": "Incomplete generation", "error_type": "incomplete_generation"}),
])
def test_engine_errors(exc, status, body):
    reply = tgi_error(exc)
    assert (reply.status, reply.body) == (status, body)
    response = reply.response()
    assert response.status_code == status
    assert response.body == json.dumps(body, separators=(",", ":")).encode()


def test_unexpected_exception_is_a_500_in_tgi_shape_not_a_trace():
    reply = tgi_error(KeyError("boom"))
    assert reply.status == 500
    assert reply.body == {"error": "Internal server error: KeyError", "error_type": "internal_error"}


def schema_error(body, schema) -> BodySchemaError:
    validator = TypedJSONBodyValidator(schema=schema, encoding="utf-8", strict_validation=False)
    with pytest.raises(BodySchemaError) as caught:
        validator._validate(body)
    return caught.value


PARAMS_SCHEMA = {"type": "object", "required": ["inputs"], "properties": {
    "inputs": {"type": "string"},
    "parameters": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "nullable": True},
        "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
        "best_of": {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
        "stop": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "top_k": {"type": "integer", "format": "int32"},
        "truncate": {"type": "integer", "minimum": 0},
        "do_sample": {"type": "boolean"},
    }},
}}


@pytest.mark.parametrize(("parameters", "status", "message"), [
    ({"temperature": -1}, 422, "Input validation error: `temperature` must be strictly positive"),
    ({"temperature": 0}, 422, "Input validation error: `temperature` must be strictly positive"),
    ({"top_p": 1.5}, 422, "Input validation error: `top_p` must be > 0.0 and < 1.0"),
    ({"best_of": 0}, 422, "Input validation error: `best_of` must be > 0 and <= 2. Given: 0"),
    ({"stop": ["a"] * 5}, 422, "Input validation error: `stop` supports up to 4 stop sequences. Given: 5"),
    ({"truncate": -3}, 422,  # usize in TGI: serde refuses it before TGI's own truncate check
     ("Failed to deserialize the JSON body into the target type: parameters.truncate: invalid value: integer "
      "`-3`, expected usize")),
    ({"temperature": "hot"}, 422,
     ("Failed to deserialize the JSON body into the target type: parameters.temperature: 'hot' is not of type "
     "'number'")),
    ({"top_k": 2**40}, 422, ("Failed to deserialize the JSON body into the target type: parameters.top_k: "
                            "invalid value: integer `1099511627776`, expected i32")),
    ({"do_sample": None}, 422, ("Failed to deserialize the JSON body into the target type: parameters.do_sample: "
                               "None is not of type 'boolean'")),
])
def test_schema_failures_get_tgi_messages(parameters, status, message):
    reply = tgi_error(schema_error({"inputs": "x", "parameters": parameters}, PARAMS_SCHEMA), LIMITS)
    assert (reply.status, reply.error, reply.error_type) == (status, message, "validation")


POSITIVE = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "nullable": True}
ORDER_SCHEMA = {"type": "object", "required": ["inputs"], "properties": {
    "inputs": {"type": "string"},
    "parameters": {"type": "object", "properties": {
        "temperature": POSITIVE, "repetition_penalty": POSITIVE, "top_k": POSITIVE,
        "top_p": {**POSITIVE, "maximum": 1}, "typical_p": {**POSITIVE, "maximum": 1},
        "max_new_tokens": {"type": "integer", "minimum": 0},
        "top_n_tokens": {"type": "integer", "minimum": 0},
        "stop": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "do_sample": {"type": "boolean"},
    }},
}}


@pytest.mark.parametrize(("parameters", "message"), [
    ({"top_k": 0, "temperature": 0}, "Input validation error: `temperature` must be strictly positive"),
    ({"typical_p": 0, "top_p": 0, "repetition_penalty": 0},
     "Input validation error: `repetition_penalty` must be strictly positive"),
    ({"typical_p": 0, "top_p": 0}, "Input validation error: `top_p` must be > 0.0 and < 1.0"),
    ({"stop": ["a"] * 5, "top_k": 0}, "Input validation error: `top_k` must be strictly positive"),
    # serde's deserialization fails before any of TGI's checks
    ({"temperature": 0, "do_sample": "yes"},
     "Failed to deserialize the JSON body into the target type: parameters.do_sample: 'yes' is not of type "
     "'boolean'"),
    ({"temperature": 0, "top_n_tokens": -1},
     ("Failed to deserialize the JSON body into the target type: parameters.top_n_tokens: invalid value: "
      "integer `-1`, expected u32")),
])
def test_several_schema_failures_answer_the_one_tgi_reports_first(parameters, message):
    reply = tgi_error(schema_error({"inputs": "x", "parameters": parameters}, ORDER_SCHEMA), LIMITS)
    assert (reply.status, reply.error) == (422, message)


def test_missing_required_field():
    reply = tgi_error(schema_error({"parameters": {}}, PARAMS_SCHEMA), LIMITS)
    assert reply.status == 422
    assert reply.error == "Failed to deserialize the JSON body into the target type: missing field `inputs`"


async def _parse(raw: bytes, encoding: str = "utf-8"):
    validator = TypedJSONBodyValidator(schema=PARAMS_SCHEMA, encoding=encoding, strict_validation=False)

    async def stream():
        yield raw

    return await validator._parse(stream(), {})


@pytest.mark.parametrize(("raw", "encoding"), [(b"{bad", "utf-8"), (b"\xff\xfe{}", "utf-8"),
                                               (b"{}", "no-such-charset"), (b"[" * 100000, "utf-8")])
async def test_unreadable_bodies_are_422_parse_errors(raw, encoding):
    with pytest.raises(BodyParseError) as caught:
        await _parse(raw, encoding)
    reply = tgi_error(caught.value, LIMITS)
    assert reply.status == 422
    assert reply.error.startswith("Failed to parse the request body as JSON: ")


def test_missing_body_is_422():
    validator = TypedJSONBodyValidator(schema=PARAMS_SCHEMA, encoding="utf-8", strict_validation=False)
    with pytest.raises(BodyParseError) as caught:
        validator._validate(None)
    assert tgi_error(caught.value).status == 422
    assert tgi_error(BadRequestProblem(detail="RequestBody is required")).status == 422


def test_wrong_content_type_is_415():
    reply = tgi_error(UnsupportedMediaTypeProblem(detail="Invalid Content-type (text/plain)"))
    assert reply.status == 415
    assert reply.body == {"error": "Expected request with `Content-Type: application/json`",
                          "error_type": "validation"}


def test_routing_errors():
    assert tgi_error(HTTPException(404)).body == {"error": "Not Found", "error_type": "not_found"}
    reply = tgi_error(HTTPException(405, headers={"Allow": "POST"}))
    assert reply.status == 405 and reply.headers == {"Allow": "POST"}
    assert reply.body["error_type"] == "method_not_allowed"
