"""Connexion's JSON body validator, made to fail with typed errors that each dialect maps to its shape.

Connexion's own validator raises a `BadRequestProblem` whose detail is a formatted string, and lets a
non-UTF-8 body or an unknown charset escape as a 500. This one parses the body itself and raises:
  * `BodyParseError` (a `BadRequestProblem`): the body is not JSON, not UTF-8, or missing;
  * `BodySchemaError` (a `BadRequestProblem`): the JSON does not match the operation's schema, with
    the failing field's path, the JSON-schema keyword that failed and the offending value, so a
    dialect can answer with its own message ("`temperature` must be strictly positive").
"""

from __future__ import annotations

import copy
import json
import typing as t

from connexion.datastructures import MediaTypeDict
from connexion.exceptions import BadRequestProblem
from connexion.json_schema import Draft4RequestValidator
from connexion.validators import VALIDATOR_MAP, JSONRequestBodyValidator
from jsonschema import Draft4Validator, FormatChecker
from jsonschema import ValidationError as JsonSchemaValidationError
from jsonschema.exceptions import best_match


class BodyParseError(BadRequestProblem):
    """The body could not be read as JSON (TGI/axum: 400 "Failed to parse the request body as JSON")."""

    def __init__(self, reason: str, *, empty: bool = False):
        super().__init__(detail=reason)
        self.reason = reason
        self.empty = empty  # no body at all (rather than a body that is not JSON)


class BodySchemaError(BadRequestProblem):
    """The JSON body breaks the operation's schema."""

    def __init__(self, *, path: tuple, keyword: str, instance: t.Any, message: str,
                 others: tuple[BodySchemaError, ...] = ()):
        super().__init__(detail=f"{message} - {'.'.join(map(str, path)) or '<body>'}")
        self.path = path  # e.g. ("parameters", "temperature")
        self.keyword = keyword  # the JSON-schema keyword that failed: "type", "minimum", "required"...
        self.instance = instance
        self.message = message
        self.others = others  # the body's other failures, so a dialect can pick the one its server reports
        self.body: t.Any = None  # the whole parsed body (set by the validator)

    @property
    def all_errors(self) -> tuple[BodySchemaError, ...]:
        return (self, *self.others)

    @property
    def field(self) -> str:
        return ".".join(map(str, self.path))

    @classmethod
    def from_jsonschema(cls, error: JsonSchemaValidationError) -> BodySchemaError:
        # Inside anyOf/oneOf the most specific sub-error names the field that is wrong.
        if error.context:
            error = best_match(error.context) or error
        path = tuple(error.absolute_path)
        message = error.message
        if error.validator == "format" and error.validator_value in INTEGER_FORMATS:
            width = "i32" if error.validator_value == "int32" else "i64"
            message = f"invalid value: integer `{error.instance}`, expected {width}"
        if error.validator == "required" and isinstance(error.instance, dict):
            required = error.validator_value or []
            missing = [name for name in required if name not in error.instance]
            if missing:
                path = (*path, missing[0])
                message = f"missing field `{missing[0]}`"
        return cls(path=path, keyword=str(error.validator), instance=error.instance, message=message)


def _refuse_constant(name: str) -> t.NoReturn:
    raise BodyParseError(f"{name} is not a JSON value")


def _lone_surrogate(value: t.Any) -> bool:
    """Whether a string anywhere in `value` holds a lone UTF-16 surrogate (only an escape like
    "\\ud800" can put one there: such text cannot be encoded, tokenized or written back)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json(text: str) -> t.Any:
    """Strict JSON, as serde_json reads it: no NaN / Infinity, no lone surrogate escapes, integers
    of any length refused with an error rather than Python's 4300-digit ValueError."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise BodyParseError(str(exc)) from exc
    except RecursionError as exc:
        raise BodyParseError("recursion limit exceeded") from exc
    except ValueError as exc:  # sys.get_int_max_str_digits(): an integer of thousands of digits
        raise BodyParseError(f"number out of range: {str(exc).split(';')[0]}") from exc
    if "\\u" in text and _lone_surrogate(value):
        raise BodyParseError("lone surrogate in hex escape: the text is not valid Unicode")
    return value


INTEGER_FORMATS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _format_checker() -> FormatChecker:
    """Draft 4's format checker plus OpenAPI's integer widths, which Connexion leaves unchecked."""
    checker = copy.deepcopy(Draft4Validator.FORMAT_CHECKER)
    for name, (low, high) in INTEGER_FORMATS.items():
        def fits(value, low=low, high=high) -> bool:
            if isinstance(value, bool) or not isinstance(value, int):
                return True
            return low <= value <= high

        checker.checks(name)(fits)
    return checker


FORMAT_CHECKER = _format_checker()


class TypedJSONBodyValidator(JSONRequestBodyValidator):
    """Drop-in for Connexion's `JSONRequestBodyValidator` raising the typed errors above."""

    @property
    def _validator(self):
        return Draft4RequestValidator(self._schema, format_checker=FORMAT_CHECKER)

    async def _parse(self, stream: t.AsyncGenerator[bytes, None], scope) -> t.Any:
        raw = b"".join([message async for message in stream])
        try:
            text = raw.decode(self._encoding)
        except (UnicodeDecodeError, LookupError) as exc:
            raise BodyParseError(f"invalid {self._encoding} body: {exc}") from exc
        if not text.strip():
            if raw:
                raise BodyParseError("EOF while parsing a value at line 1 column 0")
            return None
        return parse_json(text)

    def _validate(self, body: t.Any) -> dict | None:
        if not self._nullable and body is None:
            raise BodyParseError("EOF while parsing a value at line 1 column 0", empty=True)
        errors = sorted(self._validator.iter_errors(body), key=lambda e: list(e.absolute_path))
        if errors:
            best = best_match(errors) or errors[0]
            error = BodySchemaError.from_jsonschema(best)
            error.others = tuple(BodySchemaError.from_jsonschema(e) for e in errors if e is not best)
            error.body = body
            raise error
        return None


def validator_map() -> dict:
    """Connexion's validator map with JSON bodies checked by `TypedJSONBodyValidator`."""
    body = MediaTypeDict(dict(VALIDATOR_MAP["body"]))
    body["*/*json"] = TypedJSONBodyValidator
    return {"body": body}
