"""TGI handlers when the engine refuses or fails: status codes, bodies, in-stream error events."""

from __future__ import annotations

import json

import pytest

from opentgi.api.app import create_app
from opentgi.config import Settings
from opentgi.engine.errors import GenerationError, InputTooLongError, OverloadedError
from opentgi.engine.events import GenerationResult, SequenceResult, Timings, TokenEvent
from opentgi.engine.request import FinishReason
from tests.helpers.fake_engine import ScriptedEngine


class ScriptedHandle:
    """A RequestHandle that yields the given events, then raises `error` (if any), else ends."""

    def __init__(self, events, error=None, result=None):
        self._events = list(events)
        self._error = error
        self._result = result
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._events:
            return self._events.pop(0)
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    async def result(self):
        async for _ in self:
            pass
        return self._result

    def cancel(self):
        self.cancelled = True


def token(i: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(index=0, token_id=i, token_text=f"t{i}", logprob=-0.5, special=False, text_delta=f"t{i}",
                      generated_tokens=i, finish_reason=finish)


def sse_payloads(response) -> list[dict]:
    frames = response.content.decode().split("\n\n")[:-1]
    assert all(f.startswith("data:") for f in frames)
    return [json.loads(f[5:]) for f in frames]


def client_for(engine):
    return create_app(Settings(), engine).test_client()


BODY = {"inputs": "Hello there", "parameters": {"max_new_tokens": 3}}


def test_overloaded_is_429():
    with client_for(ScriptedEngine(submit_error=OverloadedError("busy"))) as client:
        response = client.post("/generate", json=BODY)
        assert response.status_code == 429
        assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        compat = client.post("/", json=BODY)
        assert compat.status_code == 429


def test_overloaded_stream_is_one_error_event():
    with client_for(ScriptedEngine(submit_error=OverloadedError("busy"))) as client:
        response = client.post("/generate_stream", json=BODY)
        assert response.status_code == 200
        assert sse_payloads(response) == [{"error": "Model is overloaded", "error_type": "overloaded"}]


def test_engine_limit_is_422():
    error = InputTooLongError("needs more KV cache than the pool holds", input_tokens=9, max_new_tokens=3,
                              limit=8)
    with client_for(ScriptedEngine(submit_error=error)) as client:
        response = client.post("/generate", json=BODY)
        assert response.status_code == 422
        assert response.json() == {"error": "Input validation error: needs more KV cache than the pool holds",
                                   "error_type": "validation"}


@pytest.mark.parametrize("route", ["/generate", "/"])
def test_generation_failure_is_424(route):
    handle = ScriptedHandle([token(1)], error=GenerationError("device lost"))
    with client_for(ScriptedEngine(handle=handle)) as client:
        response = client.post(route, json=BODY)
        assert response.status_code == 424
        assert response.json() == {"error": "Request failed during generation: device lost",
                                   "error_type": "generation"}


def test_generation_failure_mid_stream_ends_with_the_error_event():
    handle = ScriptedHandle([token(1), token(2)], error=GenerationError("device lost"))
    with client_for(ScriptedEngine(handle=handle)) as client:
        payloads = sse_payloads(client.post("/generate_stream", json=BODY))
    assert [p.get("index") for p in payloads[:2]] == [1, 2]
    assert payloads[2] == {"error": "Request failed during generation: device lost", "error_type": "generation"}
    assert len(payloads) == 3


def test_stream_that_ends_without_a_last_token_is_incomplete():
    handle = ScriptedHandle([token(1)])
    with client_for(ScriptedEngine(handle=handle)) as client:
        payloads = sse_payloads(client.post("/generate_stream", json=BODY))
    assert payloads[-1] == {"error": "Incomplete generation", "error_type": "incomplete_generation"}


def test_failures_are_counted_by_error_type():
    with client_for(ScriptedEngine(submit_error=OverloadedError("busy"))) as client:
        client.post("/generate", json=BODY)
        client.post("/generate_stream", json=BODY)
        metrics = client.get("/metrics").text
    assert 'tgi_request_failure{err="overloaded"} 2' in metrics


def test_the_engine_request_follows_tgi_semantics():
    sequence = SequenceResult(index=0, token_ids=[1], text="t1", finish_reason=FinishReason.LENGTH, seed=None,
                              tokens=[token(1, FinishReason.LENGTH)])
    result = GenerationResult("r", [1, 1], [sequence], Timings(queued_at=0.0, scheduled_at=0.0))
    engine = ScriptedEngine(handle=ScriptedHandle([], result=result))
    with client_for(engine) as client:
        client.post("/generate", json={"inputs": "Hello there", "parameters": {
            "max_new_tokens": 7, "stop": ["\n"], "top_k": 5, "seed": 3, "top_n_tokens": 2, "watermark": True}})
    request = engine.submitted[-1]
    assert request.stopping.max_new_tokens == 7 and request.stopping.stop_sequences == ["\n"]
    assert request.sampling.do_sample and request.sampling.top_k == 5 and request.sampling.seed == 3
    assert request.top_n_tokens == 2 and request.sampling.watermark and request.n == 1
