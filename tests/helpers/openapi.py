"""Helpers for tests that inspect the OpenAPI documents in openapi/ (no server, no engine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from connexion import AsyncApp
from connexion.resolver import Resolver
from openapi_schema_validator import OAS30Validator, oas30_format_checker

from codegen.generate import find_documents
from codegen.validate import load_document

SCHEMA_LIST_KEYS = ("allOf", "anyOf", "oneOf")
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def documents() -> dict[str, dict]:
    """Every document in openapi/, by file name."""
    return {doc.path.name: load_document(doc.path) for doc in find_documents()}


def resolve(doc: dict, node: Any) -> Any:
    """Follow local ``$ref``s until a node without one."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), f"only local references are used: {ref}"
        node = doc
        for part in ref[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _sub_schemas(schema: dict, where: str) -> Iterator[tuple[str, dict]]:
    for name, prop in schema.get("properties", {}).items():
        yield f"{where}/properties/{name}", prop
    for key in ("items", "not", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield f"{where}/{key}", schema[key]
    for key in SCHEMA_LIST_KEYS:
        for i, branch in enumerate(schema.get(key, [])):
            yield f"{where}/{key}/{i}", branch


def _walk_schema(where: str, schema: dict) -> Iterator[tuple[str, dict]]:
    yield where, schema
    for sub_where, sub in _sub_schemas(schema, where):
        yield from _walk_schema(sub_where, sub)


def media_types(doc: dict) -> Iterator[tuple[str, dict]]:
    """Every media type object (request bodies and responses) with its location."""
    for path, item in doc.get("paths", {}).items():
        for method in HTTP_METHODS:
            op = item.get(method)
            if op is None:
                continue
            body = resolve(doc, op.get("requestBody", {}))
            for ctype, media in body.get("content", {}).items():
                yield f"{method.upper()} {path} request {ctype}", media
            for status, response in op.get("responses", {}).items():
                for ctype, media in resolve(doc, response).get("content", {}).items():
                    yield f"{method.upper()} {path} {status} {ctype}", media


def schema_nodes(doc: dict) -> Iterator[tuple[str, dict]]:
    """Every schema object of the document (components and inline ones), with its location."""
    for name, schema in doc.get("components", {}).get("schemas", {}).items():
        yield from _walk_schema(f"#/components/schemas/{name}", schema)
    for where, media in media_types(doc):
        if "schema" in media:
            yield from _walk_schema(f"{where} schema", media["schema"])


def oas30_validator(doc: dict, schema: dict) -> OAS30Validator:
    """A validator for ``schema`` with OpenAPI 3.0 semantics (nullable, boolean exclusiveMinimum)."""
    rooted = {**schema, "components": doc.get("components", {})}
    return OAS30Validator(rooted, format_checker=oas30_format_checker)


async def _echo(*args: Any, **kwargs: Any) -> tuple[dict, int, dict[str, str]]:
    return {"accepted": True}, 200, {"Content-Type": "application/json"}


class EchoResolver(Resolver):
    """Resolves every operationId to one handler that accepts whatever passed validation."""

    def resolve_function_from_operation_id(self, operation_id: str):
        return _echo


def echo_app(spec: str | Any) -> AsyncApp:
    """A stock Connexion app serving ``spec``: requests are validated exactly as Connexion does."""
    app = AsyncApp(__name__)
    app.add_api(spec, resolver=EchoResolver())
    return app
