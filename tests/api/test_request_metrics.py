"""TGI's request metrics count every dialect's generation routes the same way (api/request_metrics.py):
tgi_request_count on arrival, the input length and max_new_tokens once validated, then
tgi_request_success with durations and generated tokens, or tgi_request_failure{err}."""

from __future__ import annotations

import pytest

from opentgi.api.app import create_app
from opentgi.config import Settings
from opentgi.engine.engine import Engine

# Families a successful request adds one observation to (the `_count` sample of each histogram).
SUCCESS_HISTOGRAMS = ("tgi_request_duration", "tgi_request_validation_duration", "tgi_request_queue_duration",
                      "tgi_request_inference_duration", "tgi_request_mean_time_per_token_duration",
                      "tgi_request_generated_tokens", "tgi_request_input_length", "tgi_request_max_new_tokens")


@pytest.fixture(scope="module")
def client(tiny_llama):
    settings = Settings(model_id=str(tiny_llama), device="cpu", max_input_tokens=40, max_total_tokens=64,
                        max_batch_total_tokens=1024)
    with create_app(settings, Engine.from_settings(settings)).test_client() as test_client:
        yield test_client


def samples(client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after if after[name] != before.get(name, 0.0)}


def assert_one_success(changed: dict[str, float], generated_tokens: int) -> None:
    assert changed["tgi_request_count"] == 1 and changed["tgi_request_success"] == 1
    for family in SUCCESS_HISTOGRAMS:
        assert changed[f"{family}_count"] == 1, family
    assert changed["tgi_request_generated_tokens_sum"] == generated_tokens
    assert not any(name.startswith("tgi_request_failure") for name in changed)


def assert_one_failure(changed: dict[str, float], err: str) -> None:
    assert changed["tgi_request_count"] == 1 and "tgi_request_success" not in changed
    assert changed[f'tgi_request_failure{{err="{err}"}}'] == 1
    assert "tgi_request_duration_count" not in changed


@pytest.mark.parametrize("path", ["/lightllm/generate", "/lightllm/generate_stream"])
def test_lightllm_generation_is_counted(client, path):
    before = samples(client)
    response = client.post(path, json={"inputs": "Hello", "parameters": {"max_new_tokens": 3, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    changed = delta(before, samples(client))
    assert_one_success(changed, generated_tokens=3)
    assert changed["tgi_request_max_new_tokens_sum"] == 3


def test_lightllm_refusal_is_a_validation_failure(client):
    before = samples(client)
    response = client.post("/lightllm/generate", json={"inputs": "Hello", "parameters": {
        "do_sample": True, "n": 2, "best_of": 3}})
    assert response.status_code == 422
    assert_one_failure(delta(before, samples(client)), "validation")


def test_lightllm_score_on_a_plain_model_is_a_validation_failure(client):
    before = samples(client)
    assert client.post("/lightllm/get_score", json={"chat": "Hello"}).status_code == 422
    assert_one_failure(delta(before, samples(client)), "validation")


@pytest.mark.parametrize("stream", [False, True])
def test_sensenova_completion_is_counted(client, stream):
    before = samples(client)
    response = client.post("/v1/llm/completions", json={"model": "m", "prompt": "Hello", "max_new_tokens": 3, "n": 2,
                                                        "stream": stream})
    assert response.status_code == 200, response.text
    changed = delta(before, samples(client))
    generated = changed["tgi_request_generated_tokens_sum"]
    assert 2 <= generated <= 6  # n=2 choices, each 1..3 tokens (the tiny model may end a choice early)
    assert_one_success(changed, generated_tokens=generated)


def test_sensenova_context_overflow_is_a_validation_failure(client):
    before = samples(client)
    response = client.post("/v1/llm/completions", json={"model": "m", "prompt": "Hello", "max_new_tokens": 64})
    assert response.status_code == 422, response.text
    assert_one_failure(delta(before, samples(client)), "validation")


def test_tgi_generation_is_counted_through_the_same_helper(client):
    before = samples(client)
    body = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": True}})
    changed = delta(before, samples(client))
    assert_one_success(changed, generated_tokens=body.json()["details"]["generated_tokens"])


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
def test_a_tgi_check_refused_by_the_document_is_counted_as_tgi_counts_it(client, path):
    """temperature 0 breaks the document's range, so Connexion refuses it before the handler; TGI
    refuses it in its handler (validate) and counts the request and its failure."""
    before = samples(client)
    response = client.post(path, json={"inputs": "Hello", "parameters": {"temperature": 0}})
    assert response.json()["error"] == "Input validation error: `temperature` must be strictly positive"
    assert_one_failure(delta(before, samples(client)), "validation")


def test_a_body_tgi_cannot_deserialize_is_not_counted(client):
    before = samples(client)
    response = client.post("/generate", json={"inputs": "Hello", "parameters": {"temperature": "hot"}})
    assert response.status_code == 422
    assert response.json()["error"].startswith("Failed to deserialize the JSON body into the target type: ")
    assert "tgi_request_count" not in delta(before, samples(client))
