"""SenseNova's /v1/llm/completions over real HTTP (the live server): bytes, SSE framing, errors."""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server, timeout=120) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/llm/completions", "/sensenova/v1/llm/completions"])
def test_completion_bytes(client, path):
    response = client.post(path, json={"prompt": "Hello", "model": "tiny", "max_new_tokens": 4, "n": 2})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert response.content == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert response.content.startswith(b'{"data":{"id":"')
    assert [list(c) for c in body["data"]["choices"]] == [["index", "text", "finish_reason"]] * 2
    assert list(body["data"]["usage"]) == ["prompt_tokens", "completion_tokens", "total_tokens"]
    expected = sum(4 if c["finish_reason"] == "length" else 0 for c in body["data"]["choices"])
    assert expected <= body["data"]["usage"]["completion_tokens"] <= 8


def test_stream_framing(client):
    with client.stream("POST", "/v1/llm/completions",
                       json={"prompt": "Hello", "model": "tiny", "max_new_tokens": 3, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data:[DONE]", b""]
    chunks = [json.loads(e[len(b"data:"):]) for e in events[:-2]]
    assert all(e.startswith(b'data:{"data":{"id":"') for e in events[:-2])
    assert all(e.endswith(b'},"status":{"code":0,"message":"ok"}}') for e in events[:-2])
    assert [c["data"]["choices"][0]["finish_reason"] for c in chunks][-1] in ("length", "stop")
    assert all(c["data"]["choices"][0]["finish_reason"] == "" for c in chunks[:-1])
    usage = chunks[-1]["data"]["usage"]
    assert usage["completion_tokens"] == len(chunks)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_errors_in_sensenova_shape(client):
    response = client.post("/v1/llm/completions", json={"prompt": "Hello", "model": "tiny", "n": 5})
    assert response.status_code == 400
    assert response.content == (
        b'{"error":{"code":3,"message":"invalid argument: n: 5 is greater than the maximum of 4","details":[]}}')
    response = client.post("/v1/llm/completions", json={"prompt": "Hello", "model": "tiny", "max_new_tokens": 2000})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == 3 and "must be <= the model's context length (256)" in error["message"]
    missing = client.post("/v1/llm/completions", json={"prompt": "Hello"})
    assert missing.status_code == 400 and "model" in missing.json()["error"]["message"]


def test_document_served(client):
    assert list(client.get("/sensenova/openapi.json").json()["paths"]) == ["/v1/llm/completions"]
