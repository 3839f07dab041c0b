"""The Connexion app: every OpenAPI document of the server, routed to its dialect's handler module.

There is no route table: each document's operationIds resolve to functions of its dialect module
(Connexion's `RelativeResolver`), e.g. `generate_stream` in tgi.json -> `opentgi.api.tgi.handlers.generate_stream`.

`DIALECTS` lists the documents. `Settings.api` names the dialect that owns the root paths; every
other dialect that would collide with it is mounted under its own prefix (`/tgi`, `/lightllm`).
Errors map once per dialect (`Dialect.error_shape`, the same function the dialect's handlers answer
with), whatever raised them: a handler, Connexion's request validation, or routing (404 / 405).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import connexion
from connexion import AsyncApp
from connexion.middleware import ConnexionMiddleware, MiddlewarePosition
from connexion.middleware.routing import RoutingMiddleware
from connexion.options import SwaggerUIOptions
from connexion.resolver import RelativeResolver
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import Mount as StarletteMount

from opentgi.api import request_metrics, runtime
from opentgi.api.body_validation import BodyParseError, BodySchemaError, validator_map
from opentgi.api.errors import (
    FieldLimits,
    RequestSchemaError,
    StatusError,
    UnsupportedMediaTypeError,
    tgi_error,
)
from opentgi.api.server.auth import accepted_keys
from opentgi.api.server.limits import InputLimitsMiddleware
from opentgi.api.server.request_context import RequestContextMiddleware
from opentgi.api.server.tracing import request_tracer
from opentgi.api.tenants.table import tenant_table_for
from opentgi.api.tgi.params import refusal_in_tgi_order
from opentgi.config import Settings
from opentgi.engine.errors import OpenTGIError
from opentgi.schemas import spec_path

log = logging.getLogger(__name__)

HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


@dataclass(frozen=True)
class Dialect:
    name: str  # the value of Settings.api that puts this dialect at the root
    document: str  # an OpenAPI document in openapi/ (packaged under opentgi/schemas/openapi/)
    module: str  # the handler module its operationIds resolve in
    prefix: str  # where it is mounted when it does not own the root ("" = always at the root)
    # "module:function": the dialect's one error-shape function (an OpenTGIError -> status, body,
    # headers), the same its handlers' ErrorPolicy holds; None = TGI's shape (`tgi_error`).
    error_shape: str | None = None


DIALECTS: tuple[Dialect, ...] = (
    Dialect("tgi", "tgi.json", "opentgi.api.tgi.handlers", prefix="/tgi"),
    Dialect("lightllm", "lightllm.yaml", "opentgi.api.lightllm.handlers", prefix="/lightllm",
            error_shape="opentgi.api.lightllm.errors:lightllm_error"),
    Dialect("sensenova", "sensenova.yaml", "opentgi.api.sensenova.handlers", prefix="/sensenova",
            error_shape="opentgi.api.sensenova.errors:sensenova_error"),
    Dialect("anthropic", "anthropic.yaml", "opentgi.api.anthropic.handlers", prefix="/anthropic",
            error_shape="opentgi.api.anthropic.errors:anthropic_error"),
    Dialect("openai-responses", "openai-responses.yaml", "opentgi.api.responses.handlers",
            prefix="/openai-responses", error_shape="opentgi.api.responses.errors:openai_error"),
    Dialect("tenants", "tenants.yaml", "opentgi.api.tenants.handlers", prefix=""),
    Dialect("embeddings", "embeddings.yaml", "opentgi.api.embeddings.handlers", prefix="/embeddings",
            error_shape="opentgi.api.responses.errors:openai_error"),
    Dialect("tei", "tei.yaml", "opentgi.api.tei.handlers", prefix="/tei",
            error_shape="opentgi.api.tei.errors:tei_error"),
)


@dataclass(frozen=True)
class Mount:
    dialect: Dialect
    base_path: str  # "" at the root
    paths: tuple[str, ...] | None = None  # a subset of the document's paths; None = all of them


def mounts_for(settings: Settings, dialects: tuple[Dialect, ...] = DIALECTS) -> list[Mount]:
    """Where each dialect is served: the one `settings.api` names at the root, the others at their
    prefix (a dialect with prefix "" has no colliding paths and always sits at the root). The paths of
    a prefixed dialect that clash with nothing at the root (LightLLM's /healthz, /token_load,
    /get_score) are served at the root as well."""
    names = {d.name for d in dialects}
    if settings.api not in names:
        raise ValueError(f"unknown api {settings.api!r}; expected one of {sorted(names)}")
    mounts = [Mount(d, "" if d.name == settings.api else d.prefix) for d in dialects]
    taken = {p for m in mounts if m.base_path == "" for p in _document_paths(m.dialect)}
    for mount in list(mounts):
        if mount.base_path:
            free = tuple(p for p in _document_paths(mount.dialect) if p not in taken)
            if free:
                mounts.append(Mount(mount.dialect, "", paths=free))
    return mounts


class DialectResolver(RelativeResolver):
    """operationIds resolve in the dialect's module; one already written in full
    ("opentgi.api.lightllm.handlers.health") is taken as it is."""

    def resolve_operation_id(self, operation) -> str:
        operation_id = operation.operation_id
        if operation.router_controller is None and operation_id.startswith(f"{self.root_path}."):
            return operation_id
        return super().resolve_operation_id(operation)


def _import(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _load_document(dialect: Dialect) -> dict:
    """The dialect's document, a copy of its own to change (parsed once per process: start-up
    reads each several times, and parsing YAML is not cheap)."""
    return copy.deepcopy(_parsed_document(dialect.document))


@functools.cache
def _parsed_document(name: str) -> dict:
    import json

    import yaml

    path = spec_path(name)
    with open(path, encoding="utf-8") as handle:
        if path.suffix == ".json":
            return json.load(handle)
        return yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - safe loaders only


def _document_paths(dialect: Dialect) -> list[str]:
    return list(_load_document(dialect).get("paths", {}))


def _document_subset(mount: Mount) -> dict:
    """The dialect's document with only `mount.paths` (served at the root beside the primary)."""
    document = _load_document(mount.dialect)
    document["paths"] = {p: v for p, v in document["paths"].items() if p in mount.paths}
    return document


class ErrorMapper:
    """Maps any exception raised while serving a request to the response of the path's dialect."""

    def __init__(self, mounts: list[Mount], server_state: runtime.ServerState):
        from opentgi.api.server.auth import dialect_resolver, path_matcher

        self.state = server_state
        self.by_name = {m.dialect.name: m.dialect for m in mounts}
        self.dialect_of = dialect_resolver(
            [(m.base_path, m.dialect.name, m.paths or _document_paths(m.dialect)) for m in mounts],
            default=next((m.dialect.name for m in mounts if m.base_path == ""), "tgi"))
        self.operations = [(m.base_path.rstrip("/"), path_matcher([path]), {m.upper() for m in item if m in HTTP_METHODS})
                           for m in mounts for path, item in _load_document(m.dialect)["paths"].items()
                           if m.paths is None or path in m.paths]

    def allowed_methods(self, path: str) -> str:
        """The `Allow` header of a 405: every method the documents give the path (Starlette's router
        names only those of the first route it matched, and Connexion adds one route per operation)."""
        methods = set()
        for base, has_path, operations in self.operations:
            if path.startswith(base) and has_path(path[len(base):] or "/"):
                methods |= operations
        if "GET" in methods:
            methods.add("HEAD")
        return ", ".join(sorted(methods))

    def limits(self) -> FieldLimits:
        settings, engine = self.state.settings, self.state.engine
        info = getattr(engine, "info", None)
        return FieldLimits(max_best_of=settings.max_best_of, max_stop_sequences=settings.max_stop_sequences,
                           max_top_n_tokens=settings.max_top_n_tokens,
                           max_input_tokens=getattr(info, "max_input_tokens", 0))

    def response(self, path: str, exc: Exception, operation_id: str | None = None) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 405 and self.allowed_methods(path):
            exc = HTTPException(405, headers={**(exc.headers or {}), "Allow": self.allowed_methods(path)})
        dialect = self.by_name.get(self.dialect_of(path))
        if dialect is not None and dialect.error_shape is not None:
            own = _as_dialect_error(exc)
            if own is not None:
                return _import(dialect.error_shape)(own).response()
        limits = self.limits()
        refusal = refusal_in_tgi_order(operation_id, exc, limits) if isinstance(exc, BodySchemaError) else None
        reply = tgi_error(exc if refusal is None else refusal, limits)
        if operation_id is not None:
            request_metrics.record_refused_body(operation_id, exc, reply)
        return reply.response()

    async def __call__(self, request, exc: Exception):
        """Connexion error handler: (ConnexionRequest, exception) -> response."""
        routing = request.scope.get("extensions", {}).get("connexion_routing", {})
        response = self.response(request.url.path, exc, routing.get("operation_id"))
        return connexion.lifecycle.ConnexionResponse(
            status_code=response.status_code, body=response.body, mimetype=response.media_type,
            headers={k: v for k, v in response.headers.items() if k.lower() not in ("content-length",
                                                                                      "content-type")})


def _as_dialect_error(exc: Exception) -> OpenTGIError | None:
    """Request-validation failures become the engine's ValidationError for dialects with their own shape."""
    if isinstance(exc, OpenTGIError):
        return exc
    if isinstance(exc, BodySchemaError):
        return RequestSchemaError(f"{exc.field}: {exc.message}" if exc.field else exc.message)
    if isinstance(exc, BodyParseError):
        return RequestSchemaError(f"invalid JSON body: {exc.reason}")
    if isinstance(exc, connexion.exceptions.BadRequestProblem):
        return RequestSchemaError(str(exc.detail))
    if isinstance(exc, connexion.exceptions.UnsupportedMediaTypeProblem):
        return UnsupportedMediaTypeError()
    status = getattr(exc, "status_code", None)
    if isinstance(exc, HTTPException) and status in (404, 405):
        return StatusError(status, "Not Found" if status == 404 else "Method Not Allowed", exc.headers)
    return None


class ChainedRoutingMiddleware(RoutingMiddleware):
    """Connexion's routing, with APIs that share a base path tried in the order they were added.

    Connexion points every earlier API at a base path to the newest one as its fallback, which loses
    the middle one of three (the root holds the primary dialect, SenseNova and the paths of the
    prefixed dialect that clash with nothing there): here each falls back to the next instead."""

    def add_api(self, *args, **kwargs) -> None:
        super().add_api(*args, **kwargs)
        by_path: dict[str, list] = {}
        for route in self.router.routes:
            if isinstance(route, StarletteMount):
                by_path.setdefault(route.path, []).append(route)
        for chain in by_path.values():
            for earlier, later in itertools.pairwise(chain):
                earlier.app.default = later.app


def _middlewares() -> list:
    return [ChainedRoutingMiddleware if m is RoutingMiddleware else m
            for m in ConnexionMiddleware.default_middlewares]


def app_metrics(engine, metrics=None):
    """The app's Metrics: the one given, else the one the engine already reports to, else a new one.

    For the engine's own metrics (batches, queue, KV blocks), create the engine with
    `observer=metrics.observer` and pass the same `metrics` here.
    """
    from opentgi.metrics import Metrics, MetricsObserver, install

    if metrics is None:
        observer = getattr(engine, "observer", None)
        metrics = observer.m if isinstance(observer, MetricsObserver) else Metrics()
    metrics.set_limits(engine.info.max_input_tokens, engine.info.max_total_tokens)
    metrics.set_speculate(getattr(engine.info, "speculate", 0))
    return install(metrics)  # the module-level recording functions forward to this app's instance


def create_app(settings: Settings, engine, *, metrics=None,
               dialects: tuple[Dialect, ...] = DIALECTS) -> AsyncApp:
    """The ASGI app serving every dialect's document with `engine` (started in the lifespan)."""
    server_state = runtime.ServerState(settings=settings, engine=engine, metrics=app_metrics(engine, metrics))
    tracer = request_tracer(settings.otlp_endpoint, settings.otlp_service_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()
            if tracer is not None:
                tracer.shutdown()  # send the spans still batched

    app = AsyncApp(__name__, lifespan=lifespan, validator_map=validator_map(), middlewares=_middlewares())
    mounts = mounts_for(settings, dialects)
    # Connexion sorts APIs by base path with an unstable order among equal ones, and only the first
    # API at a base path serves its Swagger UI: the primary dialect goes last, which sorts first.
    for mount in sorted(mounts, key=lambda m: m.dialect.name == settings.api):
        primary = mount.dialect.name == settings.api
        at_root_beside_primary = mount.base_path == "" and not primary
        app.add_api(
            _load_document(mount.dialect) if mount.paths is None else _document_subset(mount),
            base_path=mount.base_path or None,
            resolver=DialectResolver(mount.dialect.module),
            swagger_ui_options=SwaggerUIOptions(
                swagger_ui=not at_root_beside_primary, serve_spec=not at_root_beside_primary,
                swagger_ui_path="/docs"),
            name=mount.dialect.name,
        )
    mapper = ErrorMapper(mounts, server_state)
    app.add_error_handler(Exception, mapper)
    app.add_error_handler(HTTPException, mapper)
    app.add_error_handler(connexion.exceptions.ProblemException, mapper)
    # Outermost of ours (added first): the request id, log line and trace see every answer, 401s too.
    app.add_middleware(RequestContextMiddleware, position=MiddlewarePosition.BEFORE_EXCEPTION, tracer=tracer)
    app.add_middleware(runtime.StateMiddleware, position=MiddlewarePosition.BEFORE_EXCEPTION,
                       server_state=server_state)
    # CORS ahead of the API key (a browser's preflight carries no key): TGI's --cors-allow-origin,
    # any origin without it (as TGI 3.x), the headers a client sends its key in allowed too
    origins = [o.strip() for o in (settings.cors_allow_origin or "*").split(",") if o.strip()]
    app.add_middleware(CORSMiddleware, position=MiddlewarePosition.BEFORE_EXCEPTION, allow_origins=origins,
                       allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"])
    if not settings.disable_ui:  # ahead of the API key: the page itself holds nothing secret
        from opentgi.api.server.chat_page import ChatPageMiddleware

        app.add_middleware(ChatPageMiddleware, position=MiddlewarePosition.BEFORE_EXCEPTION)
    tenants = tenant_table_for(settings, accepted_keys(settings.api_key, settings.api_keys))
    if tenants is not None:  # every key is a tenant's: quotas, fair scheduling, usage (api/tenants/)
        from opentgi.api.server.auth import BearerAuthMiddleware
        from opentgi.api.tenants.ledger import TenantLedger

        server_state.tenants = TenantLedger(tenants, server_state.metrics)
        app.add_middleware(BearerAuthMiddleware, position=MiddlewarePosition.BEFORE_EXCEPTION,
                           tenants=tenants, error_response=mapper.response)
    # after the key check: a body is read only for a client that may send one
    app.add_middleware(InputLimitsMiddleware, position=MiddlewarePosition.BEFORE_EXCEPTION,
                       payload_limit=settings.payload_limit, error_response=mapper.response)
    app.server_state = server_state  # the CLI's server starts its drain on SIGTERM
    return app


__all__ = ["DIALECTS", "Dialect", "Mount", "create_app", "mounts_for"]
