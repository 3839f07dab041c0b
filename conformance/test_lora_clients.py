"""LoRA adapters on a live server (tiny Llama + two PEFT adapters built by `peft`, loaded with
`--lora-adapters`), through real clients: the openai SDK's `model`, huggingface_hub's
`text_generation(adapter_id=...)` (the `text-generation` package, 0.7.0, has no adapter_id), raw
HTTP for TGI's `/generate_stream` and `/` and SenseNova; `/v1/models`, `/info` and `/metrics`.

The adapters' answers themselves are checked against transformers + PEFT in tests/models/test_lora.py;
here each route must pick the adapter it names and answer exactly what `/generate` with that
adapter_id answers.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hub_errors

from conformance.live import free_port, serve
from opentgi.config import Settings
from opentgi.models.lora import TARGET_MODULES
from tests.helpers import tiny_models

torch.set_num_threads(1)

PROMPT = "The capital of France is"
NEW = 12
UNKNOWN = "Input validation error: adapter 'zzz' is not loaded; loaded adapters: 'a', 'b'"


@pytest.fixture(scope="module")
def server():
    base = tiny_models.tiny_llama_path()
    a = tiny_models.tiny_lora_path(base, seed=1, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    b = tiny_models.tiny_lora_path(base, seed=2, r=8, alpha=4, use_rslora=True, targets=list(TARGET_MODULES))
    settings = Settings(model_id=str(base), device="cpu", hostname="127.0.0.1", port=free_port(),
                        max_input_tokens=192, max_total_tokens=256, max_batch_total_tokens=2048,
                        lora_adapters=f"a={a},b={b}")
    with serve(settings, startup_timeout_s=120) as url:
        yield url, str(base)


def generate(url: str, adapter_id="<absent>") -> tuple[int, dict]:
    parameters = {"max_new_tokens": NEW, "do_sample": False}
    if adapter_id != "<absent>":
        parameters["adapter_id"] = adapter_id
    response = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)
    return response.status_code, response.json()


@pytest.fixture(scope="module")
def texts(server):
    url, base = server
    out = {}
    for adapter in (None, "a", "b"):
        status, body = generate(url, adapter) if adapter else generate(url)
        assert status == 200
        out[adapter] = body["generated_text"]
    assert len(set(out.values())) == 3  # each adapter changes the answer
    # the base model's own id, and an explicit null, select the base model
    assert generate(url, base)[1]["generated_text"] == out[None]
    assert generate(url, None)[1]["generated_text"] == out[None]
    return out


def test_openai_sdk_model_selects_the_adapter(server, texts):
    url, base = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    models = client.models.list()
    assert [m.id for m in models.data] == [base, "a", "b"]
    assert [getattr(m, "parent", None) for m in models.data] == [None, base, base]
    for model, adapter in (("a", "a"), ("b", "b"), (base, None), ("gpt-4o", None)):
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert done.choices[0].text == texts[adapter], model
        assert done.model == (adapter or base)
    streamed = client.completions.create(model="b", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == texts["b"]
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=NEW, temperature=0)
    plain = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=NEW, temperature=0)
    assert chat.model == "a" and chat.choices[0].message.content != plain.choices[0].message.content


def test_hub_client_adapter_id(server, texts):
    url, _ = server
    hub = InferenceClient(model=url, timeout=120)
    for adapter in ("a", "b"):
        assert hub.text_generation(PROMPT, max_new_tokens=NEW, adapter_id=adapter, return_full_text=False) == texts[adapter]
        tokens = hub.text_generation(PROMPT, max_new_tokens=NEW, adapter_id=adapter, stream=True)
        assert "".join(tokens) == texts[adapter]
    with pytest.raises(hub_errors.ValidationError, match="adapter 'zzz' is not loaded") as caught:
        hub.text_generation(PROMPT, max_new_tokens=NEW, adapter_id="zzz")
    assert caught.value.__cause__.response.status_code == 422


def test_unknown_adapter_is_a_422_naming_the_loaded_ones(server):
    url, _ = server
    assert generate(url, "zzz") == (422, {"error": UNKNOWN, "error_type": "validation"})
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "adapter_id": "zzz"}}
    compat = httpx.post(f"{url}/", json=body, timeout=120)
    assert compat.status_code == 422 and compat.json()["error"] == UNKNOWN
    # /generate_stream refuses as TGI refuses a stream: the error is the stream's only event
    stream = httpx.post(f"{url}/generate_stream", json=body, timeout=120)
    assert stream.text == "data:" + json.dumps({"error": UNKNOWN, "error_type": "validation"},
                                               separators=(",", ":")) + "\n\n"


def test_sensenova_model_selects_the_adapter(server, texts):
    url, _ = server

    def answer(model):
        body = {"model": model, "prompt": PROMPT, "max_new_tokens": NEW, "temperature": 1e-4,
                "repetition_penalty": 1.0}
        response = httpx.post(f"{url}/v1/llm/completions", json=body, timeout=120)
        assert response.status_code == 200
        return response.json()["data"]["choices"][0]["text"]

    assert answer("b") == texts["b"]
    assert answer("nova-ptc-xl-v1") == texts[None]


def test_info_and_metrics_name_the_adapters(server, texts):
    url, base = server
    assert httpx.get(f"{url}/info").json()["adapters"] == ["a", "b"]
    metrics = httpx.get(f"{url}/metrics").text
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("opentgi_adapter_requests_total{"):
            label, value = line.rsplit(" ", 1)
            counts[label.split('"')[1]] = float(value)
    assert counts["a"] >= 1 and counts["b"] >= 1 and counts[base] >= 3
    assert "zzz" not in counts
