"""LightLLM handlers on a real engine (tiny models): /generate, /generate_stream, /token_load, /get_score.

The handlers are called as Connexion calls them (body dict in, starlette response out), with the
engine bound through `runtime`; HTTP routing is covered by conformance/test_lightllm_http.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
import torch

from opentgi.api import runtime
from opentgi.api.lightllm import handlers as lightllm
from opentgi.api.lightllm import shapes
from opentgi.config import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_TOTAL_TOKENS = 256
POOL_TOKENS = 2048


def settings_for(path) -> Settings:
    return Settings(model_id=str(path), device="cpu", max_total_tokens=MAX_TOTAL_TOKENS, max_input_tokens=200,
                    max_batch_total_tokens=POOL_TOKENS)


async def started_engine(path):
    from opentgi.engine.engine import Engine

    settings = settings_for(path)
    settings.kv_cache_dtype = "float32"  # scores compared with transformers' float32 forward
    engine = Engine.from_settings(settings)
    await engine.start()
    return settings, engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def llama_state(tiny_llama):
    settings, engine = await started_engine(tiny_llama)
    yield runtime.ServerState(settings=settings, engine=engine)
    await engine.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def reward_state(tiny_reward):
    settings, engine = await started_engine(tiny_reward)
    yield runtime.ServerState(settings=settings, engine=engine)
    await engine.stop()


def bound(state):
    """Serve this test's handler calls from `state` (the test task's own context: nothing leaks)."""
    runtime.bind(state)


async def collect_stream(response) -> list[bytes]:
    chunks = []
    async for chunk in response.body_iterator:
        chunks.append(chunk if isinstance(chunk, bytes) else chunk.encode())
    return chunks


async def test_generate_greedy_matches_the_stream(llama_state):
    bound(llama_state)
    body = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 17, "frequency_penalty": 1}}
    answer = await lightllm.generate(body)
    assert answer.status_code == 200 and answer.media_type == "application/json"
    generated = json.loads(answer.body)
    assert list(generated) == ["generated_text", "count_output_tokens", "finish_reason", "prompt_tokens"]
    assert generated["prompt_tokens"] == 4 and generated["count_output_tokens"] == 17
    assert generated["finish_reason"] == "length" and len(generated["generated_text"]) == 1
    assert answer.body.decode() == shapes.dumps(generated)  # `", "` and `": "` separators, as LightLLM

    stream = await lightllm.generate_stream(body)
    assert stream.status_code == 200 and stream.media_type == "text/event-stream"
    chunks = await collect_stream(stream)
    assert len(chunks) == 17
    events = []
    for chunk in chunks:
        assert chunk.startswith(b"data:{") and chunk.endswith(b"}\n\n")
        events.append(json.loads(chunk[len(b"data:"):]))
    assert [e["token"]["count_output_tokens"] for e in events] == list(range(1, 18))
    assert all(e["token"]["prompt_tokens"] == 4 for e in events)
    assert [e["finished"] for e in events] == [False] * 16 + [True]
    assert [e["finish_reason"] for e in events] == [None] * 16 + ["length"]
    assert all(e["generated_text"] is None and e["details"] is None for e in events)
    assert "".join(e["token"]["text"] for e in events) == generated["generated_text"][0]


async def test_generate_n4_lists_and_details(llama_state):
    bound(llama_state)
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "n": 4, "best_of": 4, "do_sample": True,
                                              "seed": 3, "return_details": True}}
    generated = json.loads((await lightllm.generate(body)).body)
    assert len(generated["generated_text"]) == 4
    assert generated["count_output_tokens"] == [3, 3, 3, 3]
    assert generated["finish_reason"] == ["length"] * 4
    assert [[t["count_output_tokens"] for t in seq] for seq in generated["tokens"]] == [[1, 2, 3]] * 4
    assert ["".join(t["text"] for t in seq) for seq in generated["tokens"]] == generated["generated_text"]


async def test_stop_sequence_and_eos_finish_with_stop(llama_state):
    bound(llama_state)
    first = json.loads((await lightllm.generate({"inputs": "Hi", "parameters": {"max_new_tokens": 6}})).body)
    text = first["generated_text"][0]
    stop = text[len(text) // 2:][:3] or text
    stopped = json.loads((await lightllm.generate(
        {"inputs": "Hi", "parameters": {"max_new_tokens": 6, "stop_sequences": [stop]}})).body)
    assert stopped["finish_reason"] == "stop"
    out = stopped["generated_text"][0]
    assert stop in out and text.startswith(out)  # the matched stop string stays in the text (LightLLM)
    assert len(out) < len(text) or stopped["count_output_tokens"] < 6


async def test_stop_sequences_given_as_token_ids(llama_state):
    bound(llama_state)
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 6, "return_details": True}}
    first = json.loads((await lightllm.generate(body)).body)
    ids = [t["id"] for t in first["tokens"]]
    for stop, length in (([[ids[2]]], ids.index(ids[2]) + 1), ([ids[1:3]], None)):
        body = {"inputs": "Hi", "parameters": {"max_new_tokens": 6, "stop_sequences": stop}}
        stopped = json.loads((await lightllm.generate(body)).body)
        assert stopped["finish_reason"] == "stop"
        assert first["generated_text"][0].startswith(stopped["generated_text"][0])
        assert stopped["count_output_tokens"] <= (length or 3) < 6
        streamed = [json.loads(c[len(b"data:"):]) for c in await collect_stream(await lightllm.generate_stream(body))]
        assert streamed[-1]["finish_reason"] == "stop"
        assert len(streamed) == stopped["count_output_tokens"]
    response = await lightllm.generate_stream({"inputs": "Hi", "parameters": {"stop_sequences": [[10**9]]}})
    assert response.status_code == 422 and "not in the vocabulary" in json.loads(response.body)["message"]


async def test_invalid_requests_are_4xx_before_any_stream(llama_state):
    bound(llama_state)
    cases = [
        ({"inputs": "x", "parameters": {"max_new_tokens": 2, "min_new_tokens": 3}}, 422, "min_new_tokens"),
        ({"inputs": "x", "parameters": {"n": 2, "best_of": 3}}, 422, "n == best_of"),
        ({"inputs": "x", "parameters": {"n": 2}}, 422, "best_of == 1"),
        ({"inputs": "x", "multimodal_params": {"images": [{"type": "base64", "data": "AA=="}]}}, 422, "text model"),
        ({"inputs": "word " * 300}, 422, "the input prompt token len 301 is too long > 200"),
        ({"inputs": "x", "parameters": {"max_new_tokens": MAX_TOTAL_TOKENS}}, 422,
         f"the req token total len (input len + output len) is too long > max_req_total_len:{MAX_TOTAL_TOKENS}"),
    ]
    for body, status, words in cases:  # well-formed but not servable: 422
        response = await lightllm.generate_stream(body)
        assert response.status_code == status, body
        assert response.media_type != "text/event-stream"
        assert words in json.loads(response.body)["message"]


async def test_token_load_live(llama_state):
    bound(llama_state)
    engine = llama_state.engine
    assert json.loads((await lightllm.token_load()).body) == {
        "current_load": 0.0, "logical_max_load": 0.0, "dynamic_max_load": 0.0}
    prompt_tokens, max_new = 4, 200
    stream = await lightllm.generate_stream(
        {"inputs": "What is AI?", "parameters": {"max_new_tokens": max_new, "ignore_eos": True}})
    chunks = stream.body_iterator
    await chunks.__anext__()
    load = json.loads((await lightllm.token_load()).body)
    running = engine.stats().running
    async for _ in chunks:
        pass
    assert running == 1
    # One sequence: it holds prompt + generated tokens (1..200), and may reach prompt + 200.
    assert load["dynamic_max_load"] == load["logical_max_load"] == (prompt_tokens + max_new) / POOL_TOKENS
    assert (prompt_tokens + 1) / POOL_TOKENS <= load["current_load"] <= (prompt_tokens + max_new) / POOL_TOKENS
    for _ in range(100):
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.01)
    # Finished: its prompt blocks may stay cached for reuse, but cached prefixes are no load.
    assert json.loads((await lightllm.token_load()).body) == {
        "current_load": 0.0, "logical_max_load": 0.0, "dynamic_max_load": 0.0}


async def test_health(llama_state):
    bound(llama_state)
    assert (await lightllm.health()).body == b'{"message":"Ok"}'
    assert (await lightllm.healthz()).status_code == 200
    head = await lightllm.health_head()
    assert head.status_code == 200 and head.body == b""


async def test_get_score_on_a_generative_model_is_a_clear_422(llama_state):
    bound(llama_state)
    response = await lightllm.get_score({"chat": "hello"})
    assert response.status_code == 422
    assert "reward model" in json.loads(response.body)["message"]


async def test_get_score_equals_the_transformers_forward(reward_state, tiny_reward):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    bound(reward_state)
    chat = ("<|im_start|>user\nHello! What's your name?<|im_end|>\n<|im_start|>assistant\n"
            "My name is InternLM2! A helpful AI assistant.<|im_end|>\n")
    response = await lightllm.get_score({"chat": chat, "parameters": {"frequency_penalty": 1}})
    assert response.status_code == 200
    scored = json.loads(response.body)
    assert list(scored) == ["score", "prompt_tokens", "finish_reason"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_reward)
    ids = tokenizer(chat)["input_ids"]
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, 0].item()
    assert scored["prompt_tokens"] == len(ids)
    assert scored["finish_reason"] == "stop"
    assert scored["score"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert response.body.decode() == shapes.dumps(scored)


async def test_generate_on_a_reward_model_is_a_clear_422(reward_state):
    bound(reward_state)
    response = await lightllm.generate({"inputs": "hi"})
    assert response.status_code == 422 and "reward model" in json.loads(response.body)["message"]
