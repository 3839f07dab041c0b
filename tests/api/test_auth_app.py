"""--api-key on the real app: every route of every dialect needs the bearer token, health checks do not.

Also checks where the dialects live in each `--api` mode (root vs /tgi, /lightllm, /sensenova).
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
import pytest_asyncio

from opentgi.config import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY = "s3cret-key"
UNAUTHORIZED = "Unauthorized: missing or invalid bearer token"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine_and_settings(tiny_llama):
    from opentgi.engine.engine import Engine

    settings = Settings(model_id=str(tiny_llama), device="cpu", max_total_tokens=128, max_input_tokens=100,
                        max_batch_total_tokens=2048)
    engine = Engine.from_settings(settings)
    await engine.start()
    yield engine, settings
    await engine.stop()


_apps: dict = {}


def client_for(engine_and_settings, **changes) -> httpx.AsyncClient:
    """A client of the real app with `changes` to the settings (one app per settings: building one
    parses every document)."""
    from opentgi.api.app import create_app

    engine, settings = engine_and_settings
    key = (id(engine), tuple(sorted(changes.items())))
    if key not in _apps:  # the engine is already started: the app's lifespan is not needed
        _apps[key] = create_app(dataclasses.replace(settings, **changes), engine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=_apps[key]), base_url="http://test")


PROTECTED = [  # (method, path, body, expected 401 body)
    ("POST", "/generate", {"inputs": "hi"}, {"error": UNAUTHORIZED, "error_type": "unauthorized"}),
    ("GET", "/info", None, {"error": UNAUTHORIZED, "error_type": "unauthorized"}),
    ("POST", "/v1/chat/completions", {"messages": []}, {"error": UNAUTHORIZED, "error_type": "unauthorized"}),
    ("POST", "/lightllm/generate", {"inputs": "hi"}, {"message": UNAUTHORIZED}),
    ("POST", "/lightllm/generate_stream", {"inputs": "hi"}, {"message": UNAUTHORIZED}),
    ("GET", "/token_load", None, {"message": UNAUTHORIZED}),
    ("POST", "/get_score", {"chat": "hi"}, {"message": UNAUTHORIZED}),
    ("POST", "/v1/llm/completions", {"prompt": "hi", "model": "m"},
     {"error": {"code": 16, "message": UNAUTHORIZED, "details": []}}),
    ("POST", "/sensenova/v1/llm/completions", {"prompt": "hi", "model": "m"},
     {"error": {"code": 16, "message": UNAUTHORIZED, "details": []}}),
    ("POST", "/v1/messages", {"model": "m", "max_tokens": 1, "messages": []},
     {"type": "error", "error": {"type": "authentication_error", "message": UNAUTHORIZED}}),
    ("POST", "/v1/messages/count_tokens", {"model": "m", "messages": []},
     {"type": "error", "error": {"type": "authentication_error", "message": UNAUTHORIZED}}),
    ("POST", "/v1/responses", {"input": "hi"}, {"error": {"message": UNAUTHORIZED, "type": "authentication_error",
                                                           "param": None, "code": "invalid_api_key"}}),
    ("GET", "/v1/responses/resp_1", None, {"error": {"message": UNAUTHORIZED, "type": "authentication_error",
                                                      "param": None, "code": "invalid_api_key"}}),
    ("DELETE", "/v1/responses/resp_1", None, {"error": {"message": UNAUTHORIZED, "type": "authentication_error",
                                                         "param": None, "code": "invalid_api_key"}}),
]


@pytest.mark.parametrize("method, path, body, expected", PROTECTED, ids=[p[1] for p in PROTECTED])
async def test_auth_on_rejects_missing_and_wrong_keys(engine_and_settings, method, path, body, expected):
    async with client_for(engine_and_settings, api_key=KEY) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            response = await client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json() == expected
            assert response.headers["www-authenticate"] == "Bearer"


async def test_auth_on_accepts_the_key(engine_and_settings):
    headers = {"Authorization": f"Bearer {KEY}"}
    async with client_for(engine_and_settings, api_key=KEY) as client:
        generated = await client.post("/lightllm/generate", headers=headers,
                                      json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert generated.status_code == 200 and generated.json()["count_output_tokens"] == 2
        completed = await client.post("/v1/llm/completions", headers=headers,
                                      json={"prompt": "hi", "model": "m", "max_new_tokens": 2})
        assert completed.status_code == 200 and completed.json()["data"]["usage"]["completion_tokens"] == 2
        assert (await client.get("/token_load", headers=headers)).status_code == 200
        tgi = await client.post("/generate", headers=headers, json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert tgi.status_code == 200


async def test_auth_on_takes_the_key_as_x_api_key_too(engine_and_settings):
    """Anthropic's clients send `x-api-key`; every route takes it (and a wrong one is refused)."""
    async with client_for(engine_and_settings, api_key=KEY) as client:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        message = await client.post("/v1/messages", json=body, headers={"x-api-key": KEY,
                                                                         "anthropic-version": "2023-06-01"})
        assert message.status_code == 200 and message.json()["usage"]["output_tokens"] == 2
        response = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                                     headers={"x-api-key": KEY})
        assert response.status_code == 200
        wrong = await client.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"


async def test_auth_on_leaves_health_checks_open(engine_and_settings):
    async with client_for(engine_and_settings, api_key=KEY) as client:
        for path in ("/health", "/healthz", "/lightllm/health", "/lightllm/healthz"):
            assert (await client.get(path)).status_code == 200, path


async def test_auth_off_needs_no_header(engine_and_settings):
    async with client_for(engine_and_settings) as client:
        response = await client.post("/v1/llm/completions", json={"prompt": "hi", "model": "m", "max_new_tokens": 1})
        assert response.status_code == 200
        assert (await client.get("/token_load")).status_code == 200


async def test_tgi_mode_mounts(engine_and_settings):
    async with client_for(engine_and_settings, api="tgi") as client:
        body = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 2}}
        assert "generated_text" in (await client.post("/generate", json=body)).json()  # TGI: a string
        assert isinstance((await client.post("/generate", json=body)).json()["generated_text"], str)
        lightllm = (await client.post("/lightllm/generate", json=body)).json()
        assert isinstance(lightllm["generated_text"], list) and lightllm["prompt_tokens"] == 4
        assert (await client.get("/health")).content == b""  # TGI's health: an empty 200
        assert (await client.get("/lightllm/health")).content == b'{"message":"Ok"}'
        assert (await client.get("/healthz")).content == b'{"message":"Ok"}'
        assert set((await client.get("/token_load")).json()) == {"current_load", "logical_max_load",
                                                                 "dynamic_max_load"}
        assert (await client.get("/openapi.json")).json()["info"]["title"] == "Text Generation Inference"
        assert "LightLLM" in (await client.get("/lightllm/openapi.json")).json()["info"]["title"]
        assert "SenseNova" in (await client.get("/sensenova/openapi.json")).json()["info"]["title"]
        for docs in ("/docs/", "/lightllm/docs/", "/sensenova/docs/"):
            assert (await client.get(docs)).status_code == 200


async def test_lightllm_mode_mounts(engine_and_settings):
    async with client_for(engine_and_settings, api="lightllm") as client:
        body = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 2}}
        root = await client.post("/generate", json=body)
        assert json.loads(root.content)["generated_text"] and isinstance(root.json()["generated_text"], list)
        assert isinstance((await client.post("/tgi/generate", json=body)).json()["generated_text"], str)
        assert (await client.get("/health")).content == b'{"message":"Ok"}'
        head = await client.head("/health")
        assert head.status_code == 200 and head.content == b""
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/token_load")).status_code == 200
        assert (await client.post("/lightllm/generate", json=body)).status_code == 404
        assert "LightLLM" in (await client.get("/openapi.json")).json()["info"]["title"]
        assert (await client.get("/tgi/openapi.json")).json()["info"]["title"] == "Text Generation Inference"
        completed = await client.post("/v1/llm/completions", json={"prompt": "hi", "model": "m", "max_new_tokens": 1})
        assert completed.status_code == 200


async def test_several_keys_each_accepted(engine_and_settings):
    async with client_for(engine_and_settings, api_key="k1, k2", api_keys=("k3",)) as client:
        for key in ("k1", "k2", "k3"):
            response = await client.get("/info", headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, key
        assert (await client.get("/info", headers={"Authorization": "Bearer k1, k2"})).status_code == 401


async def test_cors_allows_the_listed_origins_before_the_key(engine_and_settings):
    async with client_for(engine_and_settings, api_key=KEY, cors_allow_origin="https://app.example") as client:
        preflight = await client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        answer = await client.get("/info", headers={"Origin": "https://app.example",
                                                    "Authorization": f"Bearer {KEY}"})
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        other = await client.get("/info", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
        assert "access-control-allow-origin" not in other.headers
    async with client_for(engine_and_settings) as client:  # TGI's default: any origin
        response = await client.get("/info", headers={"Origin": "https://app.example"})
        assert response.headers["access-control-allow-origin"] == "*"
