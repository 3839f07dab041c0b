"""LightLLM's API over real HTTP (the live server, `--api tgi`: LightLLM under /lightllm, its
non-clashing paths at the root): status codes, headers and bytes as LightLLM's server sends them."""

from __future__ import annotations

import json

import httpx
import pytest

LIGHTLLM_SEPARATORS = ", "  # LightLLM writes generation answers with json.dumps' default separators


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server, timeout=120) as c:
        yield c


def test_generate_bytes(client):
    response = client.post("/lightllm/generate", json={
        "inputs": "What is AI?", "parameters": {"max_new_tokens": 17, "frequency_penalty": 1},
        "multimodal_params": {}})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert response.content == json.dumps(body, ensure_ascii=False).encode()
    assert response.content.startswith(b'{"generated_text": ["')
    assert response.content.endswith(b'"count_output_tokens": 17, "finish_reason": "length", "prompt_tokens": 4}')


def test_generate_stream_bytes(client):
    with client.stream("POST", "/lightllm/generate_stream",
                       json={"inputs": "What is AI?", "parameters": {"max_new_tokens": 3}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and len(events) == 4
    for n, event in enumerate(events[:-1], start=1):
        assert event.startswith(b'data:{"token": {"id": ')
        data = json.loads(event[len(b"data:"):])
        assert event[len(b"data:"):] == json.dumps(data, ensure_ascii=False).encode()
        assert list(data) == ["token", "generated_text", "finished", "finish_reason", "details"]
        assert list(data["token"]) == ["id", "text", "logprob", "special", "count_output_tokens", "prompt_tokens"]
        assert data["token"]["count_output_tokens"] == n and data["token"]["prompt_tokens"] == 4
        last = n == 3
        assert (data["finished"], data["finish_reason"]) == ((True, "length") if last else (False, None))
    assert events[-2].endswith(b'"generated_text": null, "finished": true, "finish_reason": "length", "details": null}')


def test_invalid_stream_request_never_gets_a_200(client):
    response = client.post("/lightllm/generate_stream", json={"inputs": "x", "parameters": {"n": 2, "best_of": 2}})
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/json"
    assert response.content == b'{"message":"stream api only support best_of == 1"}'
    response = client.post("/lightllm/generate_stream", json={"inputs": "x", "parameters": {"temperature": -1}})
    assert response.status_code == 400 and set(response.json()) == {"message"}


def test_health_and_token_load_bytes(client):
    for path in ("/lightllm/health", "/lightllm/healthz", "/healthz"):
        response = client.get(path)
        assert response.status_code == 200 and response.content == b'{"message":"Ok"}', path
        assert response.headers["content-type"] == "application/json"
    head = client.head("/lightllm/health")
    assert head.status_code == 200 and head.content == b""
    load = client.get("/token_load")
    assert load.status_code == 200
    assert set(load.json()) == {"current_load", "logical_max_load", "dynamic_max_load"}
    assert load.content.startswith(b'{"current_load":')  # starlette's compact JSONResponse, as LightLLM


def test_get_score_on_a_generative_model(client):
    response = client.post("/get_score", json={"chat": "<|im_start|>user\nhi<|im_end|>\n"})
    assert response.status_code == 422
    assert "reward model" in response.json()["message"]


def test_documents_served(client):
    assert client.get("/lightllm/openapi.json").json()["paths"].keys() == {
        "/health", "/healthz", "/token_load", "/generate", "/generate_stream", "/get_score"}
    assert client.get("/lightllm/docs/").status_code == 200
