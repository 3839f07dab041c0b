"""Optional bearer-token authentication (`--api-key` / `API_KEY`, several keys comma-separated, and
`--api-key-file`, one a line), as one ASGI middleware. A token is compared with every key in
constant time (`hmac.compare_digest`), all of them whichever matches.

When the server has an API key, every HTTP route of every dialect needs `Authorization: Bearer <key>`
(or Anthropic's `x-api-key: <key>`) except the health checks (`/health`, `/healthz` under any mount)
and the API documents with their Swagger UI (`/openapi.json`, `/docs`, `/ui/...`), which hold nothing
secret. A missing or wrong key gets a 401 in the error shape of the dialect that owns the path, with `WWW-Authenticate: Bearer`.

Each key belongs to a tenant (api/tenants/: `--tenants FILE`, or the one admin tenant of
`--api-key`). The middleware binds the caller's tenant for the request (quotas, fair scheduling,
usage, the log line), and answers a non-admin tenant 403 on the admin routes (`ADMIN_PATHS`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from starlette.responses import Response

from opentgi.api.errors import ForbiddenError, UnauthorizedError
from opentgi.api.server import request_context
from opentgi.api.tenants import table as tenant_table

OPEN_PATH_NAMES = frozenset({"health", "healthz"})
# Routes only an admin tenant may call (under any mount): usage, metrics, adapters at run time.
ADMIN_PATHS = ("/metrics", "/v1/usage", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
DOC_PATH_NAMES = frozenset({"openapi.json", "openapi.yaml", "docs", "swagger.json"})


def accepted_keys(api_key: str | None, more: Iterable[str] = ()) -> list[str]:
    """The keys a server accepts: `--api-key`'s comma-separated keys and those of `--api-key-file`."""
    keys = [k.strip() for k in (api_key or "").split(",")] + [k.strip() for k in more]
    return [k for k in keys if k]


def dialect_error_response(dialect_of: Callable[[str], str]) -> Callable[[str, Exception], Response]:
    """(path, error) -> the response of the dialect owning the path, from its one error-shape function
    (the app passes its error mapper's `response` instead, which does the same)."""
    from opentgi.api.anthropic.errors import anthropic_error
    from opentgi.api.errors import tgi_error
    from opentgi.api.lightllm.errors import lightllm_error
    from opentgi.api.responses.errors import openai_error
    from opentgi.api.sensenova.errors import sensenova_error

    shapes = {"tgi": tgi_error, "lightllm": lightllm_error, "sensenova": sensenova_error,
              "anthropic": anthropic_error, "openai-responses": openai_error}
    return lambda path, exc: shapes[dialect_of(path)](exc).response()


def is_open_path(path: str) -> bool:
    """Health checks and the API documents never need the key."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return False
    if parts[-1] in OPEN_PATH_NAMES or parts[-1] in DOC_PATH_NAMES:
        return True
    return "ui" in parts[:-1] or parts[-1] == "ui"


def dialect_resolver(
    mounts: Iterable[tuple[str, str, Iterable[str]]], default: str = "tgi"
) -> Callable[[str], str]:
    """Map a request path to its dialect from the app's mounts: (base path, dialect, document paths).

    The longest base path whose document has the rest of the path wins (a templated document path,
    `/v1/responses/{response_id}`, matches any one segment there); a path no document has (a 404 to
    be) gets `default`'s shape.
    """
    table = sorted(
        ((base.rstrip("/"), dialect, path_matcher(paths)) for base, dialect, paths in mounts),
        key=lambda m: len(m[0]),
        reverse=True,
    )

    def dialect_of(path: str) -> str:
        for base, dialect, has_path in table:
            if path.startswith(base) and has_path(path[len(base):] or "/"):
                return dialect
        for base, dialect, _ in table:  # under a dialect's prefix, but no such path
            if base and (path == base or path.startswith(base + "/")):
                return dialect
        return default

    return dialect_of


def path_matcher(paths: Iterable[str]) -> Callable[[str], bool]:
    """Whether a path is one of a document's paths, `{name}` matching one segment."""
    exact = frozenset(p for p in paths if "{" not in p)
    templated = [re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(p)) + "$") for p in paths if "{" in p]
    return lambda path: path in exact or any(t.match(path) for t in templated)


def is_admin_path(path: str) -> bool:
    return path.rstrip("/").endswith(ADMIN_PATHS)


class BearerAuthMiddleware:
    """ASGI middleware: a 401 (UnauthorizedError) in the path's dialect shape unless the bearer token
    (or the `x-api-key` header, as Anthropic's clients send it) is a tenant's key; a 403
    (ForbiddenError) for a non-admin tenant on an admin route. `api_key`: keys of one admin tenant
    (`--api-key`); `tenants`: the table of `--tenants FILE` instead."""

    def __init__(self, app, *, api_key: str | Sequence[str] = (),
                 error_response: Callable[[str, Exception], Response],
                 tenants: tenant_table.TenantTable | None = None):
        if tenants is None:
            keys = [api_key] if isinstance(api_key, str) else list(api_key)
            if not keys or not all(keys):
                raise ValueError("BearerAuthMiddleware needs non-empty api keys")
            tenants = tenant_table.TenantTable.from_keys(keys)
        self.app = app
        self.tenants = tenants
        self._error_response = error_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is None:
            await self._error_response(scope["path"], UnauthorizedError())(scope, receive, send)
            return
        record = request_context.current()
        if record is not None:
            record.tenant = tenant.name
        if not tenant.admin and is_admin_path(scope["path"]):
            await self._error_response(scope["path"], ForbiddenError())(scope, receive, send)
            return
        token = tenant_table.bind(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            tenant_table.unbind(token)

    def _tenant(self, scope) -> tenant_table.Tenant | None:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    found = self.tenants.find(token.strip())
                    if found is not None:
                        return found
            elif name == b"x-api-key":
                found = self.tenants.find(value.strip())
                if found is not None:
                    return found
        return None
