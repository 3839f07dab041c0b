"""TGI 3.x's /chat_tokenize and /detokenize (vLLM's shape) on the tiny Llama's app."""

from __future__ import annotations

import json

from tests.helpers.openapi import documents, oas30_validator

TGI = documents()["tgi.json"]


def _validate(schema_name: str, value) -> None:
    oas30_validator(TGI, {"$ref": f"#/components/schemas/{schema_name}"}).validate(value)


def test_chat_tokenize_renders_and_tokenizes_as_the_chat_route(client):
    body = {"model": "tgi", "messages": [{"role": "user", "content": "Hi there"}]}
    response = client.post("/chat_tokenize", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    _validate("ChatTokenizeResponse", out)
    text = out["templated_text"]
    assert text.startswith("<|im_start|>") and "Hi there" in text and text.endswith("<|im_start|>assistant\n")
    tokens = out["tokenize_response"]
    assert "".join(t["text"] for t in tokens) == text
    assert tokens == client.post("/tokenize", json={"inputs": text}).json()
    ids = [t["id"] for t in tokens]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}


def test_chat_tokenize_bad_request_is_a_tgi_422(client):
    response = client.post("/chat_tokenize", json={"model": "tgi", "messages": [
        {"role": "user", "content": "x"}], "tool_choice": "required"})
    assert response.status_code == 422 and response.json()["error_type"] == "tool_error"


def test_detokenize_skips_special_tokens_on_request(client):
    ids = client.post("/tokenize", json={"inputs": "Hello world"}).json()
    ids = [t["id"] for t in ids]
    assert client.post("/detokenize", json={"tokens": [1, *ids, 2]}).json()["prompt"] == \
        "<|im_start|>Hello world<|im_end|>"
    out = client.post("/detokenize", json={"tokens": [1, *ids, 2], "skip_special_tokens": True}).json()
    _validate("DetokenizeResponse", out)
    assert out == {"prompt": "Hello world"}


def test_detokenize_refuses_ids_outside_the_vocabulary(client):
    response = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert response.status_code == 422
    assert response.json() == {"error": "Input validation error: token id 1000000 is outside the vocabulary (0..49151)",
                               "error_type": "validation"}


def test_cached_tokens_in_openai_usage(client):
    """The same long prompt twice: the second finds its full KV blocks in the prefix cache."""
    body = {"model": "tgi", "messages": [{"role": "user", "content": "cached words " * 3}], "max_tokens": 1}
    client.post("/v1/chat/completions", json=body)
    answer = client.post("/v1/chat/completions", json=body).json()
    assert "usage" in answer, answer
    usage = answer["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < usage["prompt_tokens"] and cached % 16 == 0
    prompt = {"model": "tgi", "prompt": "cached words " * 10, "max_tokens": 1}
    client.post("/v1/completions", json=prompt)
    stream = client.post("/v1/completions", json={**prompt, "stream": True, "stream_options": {"include_usage": True}})
    lines = [line for line in stream.text.splitlines() if line.startswith("data:")]
    final = json.loads(lines[-2][len("data:"):])
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
