"""Bearer-token middleware: 401 in each dialect's shape, health checks and documents stay open."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from opentgi.api.server.auth import (
    BearerAuthMiddleware,
    dialect_error_response,
    dialect_resolver,
    is_open_path,
)

MOUNTS = [
    ("", "tgi", ["/generate", "/generate_stream", "/health", "/info"]),
    ("/lightllm", "lightllm", ["/generate", "/generate_stream", "/health", "/healthz", "/token_load"]),
    ("", "lightllm", ["/healthz", "/token_load", "/get_score"]),
    ("", "sensenova", ["/v1/llm/completions"]),
]


async def ok(request):
    return JSONResponse({"ok": True})


def make_client(api_key: str) -> httpx.AsyncClient:
    paths = {base + p for base, _, ps in MOUNTS for p in ps}
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST", "HEAD"]) for p in paths])
    app.add_middleware(BearerAuthMiddleware, api_key=api_key,
                       error_response=dialect_error_response(dialect_resolver(MOUNTS)))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_dialect_resolver_picks_the_owning_document():
    dialect_of = dialect_resolver(MOUNTS)
    assert dialect_of("/generate") == "tgi"
    assert dialect_of("/lightllm/generate") == "lightllm"
    assert dialect_of("/lightllm/nope") == "lightllm"
    assert dialect_of("/token_load") == "lightllm"
    assert dialect_of("/get_score") == "lightllm"
    assert dialect_of("/v1/llm/completions") == "sensenova"
    assert dialect_of("/unknown") == "tgi"


def test_open_paths():
    assert is_open_path("/health") and is_open_path("/healthz") and is_open_path("/lightllm/health")
    assert is_open_path("/openapi.json") and is_open_path("/lightllm/ui/") and is_open_path("/docs")
    assert not is_open_path("/generate") and not is_open_path("/") and not is_open_path("/token_load")


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", b'{"error":"Unauthorized: missing or invalid bearer token","error_type":"unauthorized"}'),
        ("/lightllm/generate", b'{"message":"Unauthorized: missing or invalid bearer token"}'),
        ("/get_score", b'{"message":"Unauthorized: missing or invalid bearer token"}'),
        (
            "/v1/llm/completions",
            b'{"error":{"code":16,"message":"Unauthorized: missing or invalid bearer token","details":[]}}',
        ),
    ],
)
@pytest.mark.parametrize("header", [None, "Bearer wrong", "secret", "Basic secret"])
async def test_missing_or_wrong_key_is_401_in_the_dialect_shape(path, body, header):
    headers = {"Authorization": header} if header else {}
    async with make_client("secret") as client:
        response = await client.post(path, json={}, headers=headers)
    assert response.status_code == 401
    assert response.content == body
    assert response.headers["content-type"] == "application/json"
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/generate", "/lightllm/token_load", "/v1/llm/completions"])
@pytest.mark.parametrize("header", ["Bearer secret", "bearer secret", "Bearer  secret "])
async def test_right_key_passes(path, header):
    async with make_client("secret") as client:
        response = await client.post(path, json={}, headers={"Authorization": header})
    assert response.status_code == 200 and response.json() == {"ok": True}


@pytest.mark.parametrize("path", ["/health", "/healthz", "/lightllm/health", "/lightllm/healthz"])
async def test_health_checks_need_no_key(path):
    async with make_client("secret") as client:
        assert (await client.get(path)).status_code == 200
        assert (await client.head(path)).status_code == 200


def test_bodies_come_from_each_dialects_one_error_shape():
    from opentgi.api.errors import UnauthorizedError, tgi_error
    from opentgi.api.lightllm.errors import lightllm_error
    from opentgi.api.sensenova.errors import sensenova_error

    exc = UnauthorizedError("x")
    assert tgi_error(exc).body == {"error": "x", "error_type": "unauthorized"}
    assert lightllm_error(exc).body == {"message": "x"}
    assert sensenova_error(exc).body == {"error": {"code": 16, "message": "x", "details": []}}
    assert {tgi_error(exc).status, lightllm_error(exc).status, sensenova_error(exc).status} == {401}


def test_empty_key_is_refused():
    with pytest.raises(ValueError):
        BearerAuthMiddleware(None, api_key="", error_response=dialect_error_response(lambda p: "tgi"))
