"""Limits on the way in: body size (--payload-limit), content type, strict JSON, text length before
tokenizing. Every refusal is a JSON 4xx in the shape of the dialect that owns the path."""

from __future__ import annotations

import json

import pytest

from opentgi.api.app import create_app
from opentgi.config import Settings
from tests.helpers.fake_engine import FakeEngine

# (path, a body the route accepts, how its error body names the message)
ROUTES = {
    "tgi": ("/generate", {"inputs": "x"}, lambda b: b["error"]),
    "openai": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, lambda b: b["error"]),
    "lightllm": ("/lightllm/generate", {"inputs": "x"}, lambda b: b["message"]),
    "sensenova": ("/v1/llm/completions", {"model": "m", "prompt": "x"}, lambda b: b["error"]["message"]),
}


@pytest.fixture(scope="module")
def client():
    with create_app(Settings(payload_limit=10_000), FakeEngine()).test_client() as c:
        yield c


@pytest.mark.parametrize("dialect", list(ROUTES))
def test_a_body_past_the_payload_limit_is_413(client, dialect):
    path, body, message = ROUTES[dialect]
    big = json.dumps({**body, "pad": "y" * 20_000}).encode()
    response = client.post(path, content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "length limit exceeded" in message(response.json())

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    response = client.post(path, content=chunked(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "length limit exceeded" in message(response.json())


def test_the_payload_limit_is_tgis_two_megabytes_by_default():
    assert Settings().payload_limit == 2_000_000


@pytest.mark.parametrize("dialect", list(ROUTES))
def test_a_body_without_content_type_is_415(client, dialect):
    path, body, message = ROUTES[dialect]
    response = client.post(path, content=json.dumps(body).encode())  # no Content-Type header at all
    assert response.status_code == 415
    assert "Content-Type: application/json" in message(response.json())


@pytest.mark.parametrize("dialect", list(ROUTES))
@pytest.mark.parametrize("raw, reason", [
    (b'"seed": NaN', "NaN is not a JSON value"),
    (b'"seed": -Infinity', "-Infinity is not a JSON value"),
    (b'"seed": ' + b"7" * 5000, "number out of range"),
    (b'"extra": "\\ud800"', "lone surrogate"),
])
def test_json_that_python_reads_but_serde_does_not_is_refused(client, dialect, raw, reason):
    path, body, message = ROUTES[dialect]
    text = json.dumps(body).encode()
    response = client.post(path, content=text[:-1] + b", " + raw + b"}", headers={"content-type": "application/json"})
    assert response.status_code in (400, 422)  # LightLLM and SenseNova: 400 for a body that breaks the document
    assert reason in message(response.json())


def test_openai_temperature_nan_is_refused(client):
    response = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}], '
                           b'"temperature": NaN}', headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["error_type"] == "validation"


def test_tokenize_is_capped(client):
    limit = FakeEngine().info.max_batch_total_tokens * 16
    with create_app(Settings(), FakeEngine()).test_client() as big_client:
        response = big_client.post("/tokenize", json={"inputs": "a" * (limit + 1)})
        assert response.status_code == 422 and "too long to tokenize" in response.json()["error"]
        assert big_client.post("/tokenize", json={"inputs": "ab"}).status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tiny_llama):
    from opentgi.engine.engine import Engine

    settings = Settings(model_id=str(tiny_llama), device="cpu", max_input_tokens=32, max_total_tokens=64,
                        max_batch_total_tokens=1024)
    engine = Engine.from_settings(settings)

    class NoTokenizing:  # the engine's tokenizer, failing the test if a too-long prompt reaches it
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def get_vocab(self):
            return self.tokenizer.get_vocab()

        def __call__(self, text, **kwargs):
            assert len(text) < 10_000, "a prompt that cannot fit was tokenized"
            return self.tokenizer(text, **kwargs)

    engine.tokenizer = NoTokenizing(engine.tokenizer)
    with create_app(settings, engine).test_client() as client:
        response = client.post("/generate", json={"inputs": "hello " * 100_000})
        assert response.status_code == 422 and "at least" in response.json()["error"]
        response = client.post("/lightllm/generate", json={"inputs": "hello " * 100_000})
        assert response.status_code == 422 and "at least" in response.json()["message"]
        # with `truncate`, TGI keeps the last tokens: a long prompt is tokenized and served
        response = client.post("/generate", json={"inputs": "hello " * 1000, "parameters": {
            "truncate": 8, "max_new_tokens": 2}})
        assert response.status_code == 200, response.text
