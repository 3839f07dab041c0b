"""The launcher's router limits flow from the command line into TGI's validation and /info."""

from __future__ import annotations

import pytest

from opentgi.api.app import create_app
from opentgi.cli import build_parser, settings_from
from opentgi.engine.engine import Engine

PREFIX = "Input validation error: "


@pytest.fixture(scope="module")
def client(tiny_llama):
    argv = ["serve", "--model-id", str(tiny_llama), "--device", "cpu", "--max-input-tokens", "40",
            "--max-total-tokens", "64", "--max-batch-total-tokens", "1024", "--max-best-of", "3",
            "--max-top-n-tokens", "7", "--disable-grammar-support"]
    settings = settings_from(build_parser().parse_args(argv), {"MAX_STOP_SEQUENCES": "6"})
    with create_app(settings, Engine.from_settings(settings)).test_client() as test_client:
        yield test_client


def generate(client, **parameters):
    return client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2, **parameters}})


def test_info_reports_the_limits(client):
    info = client.get("/info").json()
    assert (info["max_best_of"], info["max_stop_sequences"]) == (3, 6)
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (40, 64)
    assert info["deterministic"] is True  # batch-invariant unless started with --nondeterministic
    assert info["kernels"].startswith("torch (")  # a tiny Llama folder: no GGUF blocks to serve
    # --kv-cache-dtype auto: float16 under a float32 model (CPUs without native bfloat16), else the model's
    assert info["kv_cache_dtype"] == ("float16" if info["model_dtype"] == "torch.float32" else "bfloat16")


def test_stop_sequences_up_to_the_configured_limit(client):
    assert generate(client, stop=["x1", "x2", "x3", "x4", "x5", "x6"]).status_code == 200  # TGI's default is 4
    response = generate(client, stop=["x"] * 7)
    assert response.status_code == 422
    assert response.json()["error"] == PREFIX + "`stop` supports up to 6 stop sequences. Given: 7"


def test_top_n_tokens_up_to_the_configured_limit(client):
    body = generate(client, top_n_tokens=7, details=True).json()
    assert all(len(top) >= 7 for top in body["details"]["top_tokens"])
    assert generate(client, top_n_tokens=8).json()["error"] == \
        PREFIX + "`top_n_tokens` must be >= 0 and <= 7. Given: 8"


def test_best_of_up_to_the_configured_limit(client):
    body = generate(client, best_of=3, do_sample=True, details=True).json()
    assert len(body["details"]["best_of_sequences"]) == 2
    assert generate(client, best_of=4, do_sample=True).json()["error"] == \
        PREFIX + "`best_of` must be > 0 and <= 3. Given: 4"


@pytest.mark.parametrize("grammar", [{"type": "regex", "value": "a+"},
                                     {"type": "json", "value": {"type": "object", "properties": {}}}])
def test_grammar_support_disabled(client, grammar):
    response = generate(client, grammar=grammar)
    assert response.status_code == 422
    assert response.json() == {"error": PREFIX + "grammar is not supported", "error_type": "validation"}
