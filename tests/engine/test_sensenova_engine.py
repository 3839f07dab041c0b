"""SenseNova's /v1/llm/completions on a real engine (tiny Llama): every finish reason, n = 4, streaming.

`temperature` = 1e-4 sharpens the distribution to its most likely token, so the sampled output is the
greedy one and a second request can aim a stop string or a sensitive word at text the first produced.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import pytest_asyncio

from opentgi.api import runtime
from opentgi.api.sensenova import handlers as sensenova
from opentgi.config import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_TOTAL_TOKENS = 128
GREEDY = {"temperature": 1e-4}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def state(tiny_llama):
    from opentgi.engine.engine import Engine

    settings = Settings(model_id=str(tiny_llama), device="cpu", max_total_tokens=MAX_TOTAL_TOKENS,
                        max_input_tokens=MAX_TOTAL_TOKENS - 1, max_batch_total_tokens=4096)
    engine = Engine.from_settings(settings)
    await engine.start()
    yield runtime.ServerState(settings=settings, engine=engine)
    await engine.stop()


def bind(state, **settings_changes):
    """Serve this test's handler calls from `state` (the test task's own context: nothing leaks)."""
    if settings_changes:
        state = runtime.ServerState(settings=dataclasses.replace(state.settings, **settings_changes),
                                    engine=state.engine)
    runtime.bind(state)


async def complete(**body) -> tuple[int, dict]:
    response = await sensenova.completions({"model": "tiny", **body})
    return response.status_code, json.loads(response.body)


async def stream(**body) -> list[bytes]:
    response = await sensenova.completions({"model": "tiny", "stream": True, **body})
    assert response.status_code == 200 and response.media_type == "text/event-stream"
    return [c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator]


async def test_length_and_response_shape(state):
    bind(state)
    status, body = await complete(prompt="Hello there", max_new_tokens=5, **GREEDY)
    assert status == 200
    assert list(body) == ["data"] and list(body["data"]) == ["id", "choices", "usage"]
    assert body["data"]["choices"][0]["finish_reason"] == "length"
    assert list(body["data"]["choices"][0]) == ["index", "text", "finish_reason"]
    usage = body["data"]["usage"]
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == usage["prompt_tokens"] + 5


async def test_stop_string_ends_with_stop_and_is_not_emitted(state):
    bind(state)
    _, first = await complete(prompt="Hello there", max_new_tokens=8, **GREEDY)
    text = first["data"]["choices"][0]["text"]
    stop = text[len(text) // 2:][:4].strip() or text.strip()
    _, stopped = await complete(prompt="Hello there", max_new_tokens=8, stop=stop, **GREEDY)
    choice = stopped["data"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert stop not in choice["text"] and text.startswith(choice["text"])


async def test_sensitive_word_stops_before_the_term(state):
    bind(state)
    _, first = await complete(prompt="Tell me a story", max_new_tokens=10, **GREEDY)
    text = first["data"]["choices"][0]["text"]
    word = text[len(text) // 2:][:5].strip()
    assert word
    bind(state, sensitive_words=[word])
    _, filtered = await complete(prompt="Tell me a story", max_new_tokens=10, **GREEDY)
    choice = filtered["data"]["choices"][0]
    assert choice["finish_reason"] == "sensitive"
    assert word not in choice["text"] and text.startswith(choice["text"])
    chunks = await stream(prompt="Tell me a story", max_new_tokens=10, **GREEDY)
    events = [json.loads(c[len(b"data:"):]) for c in chunks[:-1]]
    assert word not in "".join(e["data"]["choices"][0]["delta"] for e in events)
    assert events[-1]["data"]["choices"][0]["finish_reason"] == "sensitive"


async def test_context_when_the_default_runs_into_the_window(state):
    bind(state)
    prompt_ids = (await state.engine.encode("one two three " * 40))[: MAX_TOTAL_TOKENS - 6]
    prompt = state.engine.tokenizer.decode(prompt_ids)
    status, body = await complete(prompt=prompt, **GREEDY)  # max_new_tokens: the default, 1024
    assert status == 200
    choice, usage = body["data"]["choices"][0], body["data"]["usage"]
    assert choice["finish_reason"] == "context"
    assert usage["total_tokens"] == MAX_TOTAL_TOKENS


async def test_explicit_max_new_tokens_past_the_context_is_a_422(state):
    bind(state)
    status, body = await complete(prompt="hi", max_new_tokens=MAX_TOTAL_TOKENS)
    assert status == 422
    assert body["error"]["code"] == 3 and body["error"]["details"] == []
    assert "must be <= the model's context length (128)" in body["error"]["message"]


async def test_n4_choices(state):
    bind(state)
    status, body = await complete(prompt="Once upon a time", n=4, max_new_tokens=4)
    assert status == 200
    choices = body["data"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)
    assert body["data"]["usage"]["completion_tokens"] <= 16


async def test_stream_framing_usage_on_the_last_chunk_then_done(state):
    bind(state)
    chunks = await stream(prompt="Once upon a time", n=4, max_new_tokens=3, **GREEDY)
    assert chunks[-1] == b"data:[DONE]\n\n"
    events = []
    for chunk in chunks[:-1]:
        assert chunk.startswith(b"data:{") and chunk.endswith(b"}\n\n")
        events.append(json.loads(chunk[len(b"data:"):]))
    assert all(e["status"] == {"code": 0, "message": "ok"} for e in events)
    assert len({e["data"]["id"] for e in events}) == 1
    zero = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    assert all(e["data"]["usage"] == zero for e in events[:-1])
    last_usage = events[-1]["data"]["usage"]
    assert last_usage["completion_tokens"] == 12
    assert last_usage["total_tokens"] == last_usage["prompt_tokens"] + 12
    finals = [c for e in events for c in e["data"]["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in finals)
    texts = ["".join(c["delta"] for e in events for c in e["data"]["choices"] if c["index"] == i) for i in range(4)]
    _, whole = await complete(prompt="Once upon a time", n=4, max_new_tokens=3, **GREEDY)
    assert texts == [c["text"] for c in whole["data"]["choices"]]  # greedy: the same four texts
