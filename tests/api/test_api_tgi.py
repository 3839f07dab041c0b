"""The TGI routes through the real app and a tiny engine: shapes checked against openapi/tgi.json."""

from __future__ import annotations

import json
import time

import pytest
from openapi_schema_validator import OAS30Validator, oas30_format_checker

from opentgi.schemas import spec_path
from tests.helpers.engine import APP_MAX_INPUT as MAX_INPUT
from tests.helpers.engine import APP_MAX_TOTAL as MAX_TOTAL

DOCUMENT = json.loads(spec_path("tgi.json").read_text())


def validate(instance, schema_name: str) -> None:
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": DOCUMENT["components"]}
    OAS30Validator(root, format_checker=oas30_format_checker).validate(instance)


def events(response) -> list[dict]:
    raw = response.content
    assert raw.endswith(b"\n\n")
    frames = raw.decode().split("\n\n")[:-1]
    assert all(frame.startswith("data:{") for frame in frames), frames
    return [json.loads(frame[len("data:"):]) for frame in frames]


def test_generate_details_and_headers(client):
    response = client.post("/generate", json={"inputs": "Hello world", "parameters": {
        "max_new_tokens": 4, "details": True, "decoder_input_details": True, "top_n_tokens": 2}})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    validate(body, "GenerateResponse")
    details = body["details"]
    assert details["generated_tokens"] == 4 == len(details["tokens"])
    assert details["finish_reason"] == "length"
    assert details["seed"] is None  # greedy
    assert details["prefill"][0]["logprob"] is None and len(details["prefill"]) >= 2
    assert all(p["logprob"] is not None for p in details["prefill"][1:])
    assert [len(top) >= 2 for top in details["top_tokens"]] == [True] * 4
    assert body["generated_text"] == "".join(t["text"] for t in details["tokens"])
    assert list(body) == ["generated_text", "details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens"]
    headers = response.headers
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert headers[name].isdigit(), name
    float(headers["x-compute-time"])
    assert headers["x-compute-type"] == "cpu+optimized"
    assert headers["x-compute-characters"] == str(len("Hello world"))
    assert headers["x-generated-tokens"] == "4"
    assert int(headers["x-prompt-tokens"]) == len(details["prefill"])


def test_generate_without_details_is_only_the_text(client):
    body = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).json()
    assert list(body) == ["generated_text"]
    validate(body, "GenerateResponse")


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(client):
    def text(parameters):
        return client.post("/generate", json={"inputs": "Once upon", "parameters": parameters}).json()

    assert text({"max_new_tokens": 5}) == text({"max_new_tokens": 5})
    seeded = {"max_new_tokens": 5, "do_sample": True, "seed": 7, "details": True}
    first, second = text(seeded), text(seeded)
    assert first == second and first["details"]["seed"] == 7


def test_best_of_returns_the_best_and_the_others(client):
    body = client.post("/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 3, "best_of": 2, "do_sample": True, "details": True}}).json()
    validate(body, "GenerateResponse")
    others = body["details"]["best_of_sequences"]
    assert len(others) == 1
    mean = [sum(t["logprob"] for t in d["tokens"]) / len(d["tokens"]) for d in (body["details"], others[0])]
    assert mean[0] >= mean[1]
    assert body["details"]["seed"] is not None and others[0]["seed"] is not None


def test_stop_sequence_stays_in_the_text(client):
    greedy = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 6,
                                                                            "details": True}}).json()
    stop = "".join(t["text"] for t in greedy["details"]["tokens"][:3])  # the text through token 3
    body = client.post("/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 6, "stop": [stop], "details": True}}).json()
    assert body["generated_text"] == stop
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] == 3


def test_return_full_text_and_compat_route(client):
    body = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2,
                                                                          "return_full_text": True}}).json()
    assert body["generated_text"].startswith("Hi")
    array = client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert array.status_code == 200 and array.headers["content-type"] == "application/json"
    assert isinstance(array.json(), list) and len(array.json()) == 1
    assert array.json()[0]["generated_text"].startswith("Hi")  # text-generation: full text by default
    off = client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "return_full_text": False}})
    assert off.json()[0]["generated_text"] == array.json()[0]["generated_text"][2:]


def test_max_new_tokens_null_fills_the_context(client):
    body = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": None,
                                                                          "details": True}}).json()
    details = body["details"]
    assert details["generated_tokens"] + len(client.post("/tokenize", json={"inputs": "Hi"}).json()) <= MAX_TOTAL


def test_generate_stream_events(client):
    response = client.post("/generate_stream", json={"inputs": "Hello", "parameters": {
        "max_new_tokens": 3, "details": True, "top_n_tokens": 1}})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["x-accel-buffering"] == "no"
    stream = events(response)
    assert [e["index"] for e in stream] == [1, 2, 3]
    for event in stream:
        validate(event, "StreamResponse")
        assert len(event["top_tokens"]) >= 1
    assert all(e["generated_text"] is None and e["details"] is None for e in stream[:-1])
    last = stream[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in stream)
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 3, "seed": None}
    assert list(stream[0]) == ["index", "token", "top_tokens", "generated_text", "details"]


def test_compat_stream(client):
    response = client.post("/", json={"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 2}})
    stream = events(response)
    assert len(stream) == 2 and stream[-1]["generated_text"].startswith("Hello")


def test_streaming_validation_error_is_the_only_event(client):
    response = client.post("/generate_stream", json={"inputs": "Hello", "parameters": {"best_of": 2}})
    assert response.status_code == 200
    assert events(response) == [{"error": "Input validation error: `best_of` != 1 is not supported when "
                                          "streaming tokens", "error_type": "validation"}]


@pytest.mark.parametrize(("parameters", "message"), [
    ({"temperature": -1.0}, "Input validation error: `temperature` must be strictly positive"),
    ({"top_p": 1.0}, "Input validation error: `top_p` must be > 0.0 and < 1.0"),
    ({"stop": ["a"] * 5}, "Input validation error: `stop` supports up to 4 stop sequences. Given: 5"),
])
def test_generate_validation_errors(client, parameters, message):
    response = client.post("/generate", json={"inputs": "Hi", "parameters": parameters})
    assert response.status_code == 422
    assert response.json() == {"error": message, "error_type": "validation"}
    validate(response.json(), "ErrorResponse")


def test_prompt_and_new_tokens_past_the_total(client):
    prompt_tokens = len(client.post("/tokenize", json={"inputs": "Hi"}).json())
    response = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 64}})
    assert response.status_code == 422
    assert response.json()["error"] == ("Input validation error: `inputs` tokens + `max_new_tokens` must be "
                                        f"<= 64. Given: {prompt_tokens} `inputs` tokens and 64 `max_new_tokens`")


def test_prompt_too_long(client):
    words = 1
    while len(client.post("/tokenize", json={"inputs": "word " * words}).json()) <= MAX_INPUT:
        words += 1
    prompt_tokens = len(client.post("/tokenize", json={"inputs": "word " * words}).json())
    response = client.post("/generate", json={"inputs": "word " * words, "parameters": {"max_new_tokens": 1}})
    assert response.status_code == 422
    assert response.json()["error"] == ("Input validation error: `inputs` must have less than 40 tokens. "
                                        f"Given: {prompt_tokens}")


def test_bad_requests_are_4xx_in_tgi_shape(client):
    cases = [
        (client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}), 422),
        (client.post("/generate", content=b"\xff\xfe", headers={"content-type": "application/json"}), 422),
        (client.post("/generate", content=b"{}", headers={"content-type": "text/plain"}), 415),
        (client.post("/generate", json={"inputs": "x", "parameters": {"seed": 2**64}}), 422),
        (client.post("/generate", json={"inputs": "x", "parameters": {"top_k": 2**31}}), 422),
        (client.post("/generate", json={"inputs": 3}), 422),
        (client.get("/no/such/route"), 404),
        (client.get("/generate"), 405),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert set(response.json()) == {"error", "error_type"}


def test_info(client, engine):
    _settings, eng = engine
    response = client.get("/info")
    body = response.json()
    validate(body, "Info")
    assert body["model_id"] == eng.info.model_id
    assert body["model_dtype"] == "torch.float32" and body["model_device_type"] == "cpu"
    assert body["max_input_tokens"] == MAX_INPUT and body["max_total_tokens"] == MAX_TOTAL
    assert body["max_batch_total_tokens"] == eng.info.max_batch_total_tokens
    assert body["router"] == "opentgi" and body["docker_label"] is None
    assert set(body) == set(DOCUMENT["components"]["schemas"]["Info"]["properties"])


def test_info_names_the_architecture_and_those_of_the_paged_path(client, engine):
    """opentgi additions: the served model's architecture and the architectures served natively."""
    from opentgi.models.registry import PAGED_ARCHITECTURES

    body = client.get("/info").json()
    assert body["model_architecture"] == "LlamaForCausalLM"  # the tiny test model
    assert body["supported_architectures"] == list(PAGED_ARCHITECTURES)
    assert {"Gemma2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"} <= set(body["supported_architectures"])


def test_tokenize_offsets_slice_back(client):
    """start/stop are UTF-8 byte offsets, as TGI's Rust tokenizer reports them."""
    text = "Hello wörld, ünïcode ok"
    raw = text.encode("utf-8")
    tokens = client.post("/tokenize", json={"inputs": text}).json()
    for token in tokens:
        validate(token, "SimpleToken")
        assert raw[token["start"]:token["stop"]].decode("utf-8") == token["text"]
    assert tokens[-1]["stop"] == len(raw) > len(text)
    truncated = client.post("/tokenize", json={"inputs": text, "parameters": {"truncate": 2}}).json()
    assert truncated == tokens[-2:]


def test_tokenize_without_fast_tokenizer(client, engine, monkeypatch):
    _, eng = engine
    monkeypatch.setattr(type(eng.tokenizer), "is_fast", property(lambda self: False))
    response = client.post("/tokenize", json={"inputs": "Hi"})
    assert response.status_code == 404
    assert response.json() == {"error": "No fast tokenizer or tokenizer.json for this model",
                               "error_type": "no fast tokenizer"}


def test_health_probes_then_fails_when_the_loop_stalls(client, engine, monkeypatch):
    _, eng = engine
    response = client.get("/health")
    assert response.status_code == 200 and response.content == b""
    monkeypatch.setattr(eng, "_step_started_at", time.monotonic() - 10_000)  # one step "running" for hours
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}


def test_docs_and_document_are_served(client):
    assert client.get("/docs/").status_code == 200
    assert client.get("/openapi.json").json()["info"]["title"] == "Text Generation Inference"


def _sample(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    return sum(values)


def test_metrics_count_requests_successes_and_failures(client):
    before = client.get("/metrics").text
    client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    client.post("/generate", json={"inputs": "Hi", "parameters": {"top_p": 1.0}})
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    after = response.text
    assert _sample(after, "tgi_request_count") == _sample(before, "tgi_request_count") + 2
    assert _sample(after, "tgi_request_success") == _sample(before, "tgi_request_success") + 1
    failures = 'tgi_request_failure{err="validation"}'
    assert _sample(after, failures) == _sample(before, failures) + 1
    assert _sample(after, "tgi_request_generated_tokens_count") >= 1


def test_integer_widths_are_tgi_rust_types(client):
    """seed is u64, max_new_tokens and top_n_tokens u32 in TGI: values past i64/i32 that fit are served
    or reach TGI's own checks; wider ones are serde's error, without "Input validation error"."""
    body = client.post("/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 2, "do_sample": True, "seed": 2**64 - 1, "details": True}}).json()
    assert body["details"]["seed"] == 2**64 - 1
    response = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3_000_000_000}})
    assert response.json()["error"].startswith("Input validation error: `inputs` tokens + `max_new_tokens` must be")
    response = client.post("/generate", json={"inputs": "Hi", "parameters": {"seed": 2**64}})
    assert response.status_code == 422
    assert response.json() == {"error": "Failed to deserialize the JSON body into the target type: parameters.seed: "
                                        f"invalid value: integer `{2**64}`, expected u64", "error_type": "validation"}


@pytest.mark.parametrize("path", ["/generate_stream", "/generate"])
def test_a_body_tgi_cannot_deserialize_is_refused_before_any_stream_and_not_counted(client, path):
    before = client.get("/metrics").text
    response = client.post(path, json={"inputs": "Hi", "parameters": {"max_new_tokens": 2**32}})
    assert response.status_code == 422 and response.headers["content-type"] == "application/json"
    assert response.json()["error"] == ("Failed to deserialize the JSON body into the target type: "
                                        f"parameters.max_new_tokens: invalid value: integer `{2**32}`, expected u32")
    assert _sample(client.get("/metrics").text, "tgi_request_count") == _sample(before, "tgi_request_count")
