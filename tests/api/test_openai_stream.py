"""The streaming logic of the OpenAI routes (opentgi.api.openai.chat / openai_completions), driven by fake engine handles:
chunk order, n interleaved choices, tool-call deltas, include_usage, an error mid-stream."""

from __future__ import annotations

import json
from functools import partial
from types import SimpleNamespace

import pytest

from opentgi.api import generation, runtime
from opentgi.api.chat import ChatOutputParser, PreparedTurn
from opentgi.api.chat.markers import ChatMarkers
from opentgi.api.openai import chat, common, completions
from opentgi.api.openai import shapes as shape
from opentgi.config import Settings
from opentgi.engine.errors import GenerationError
from opentgi.engine.events import PrefillToken, TokenEvent
from opentgi.engine.request import FinishReason

META = shape.ResponseMeta(id="x-1", created=1, model="m")


class FakeHandle:
    def __init__(self, events, error: Exception | None = None, prefill: list[PrefillToken] | None = None):
        self.events = list(events)
        self.error = error
        self.cancelled = False
        self.prefill = prefill

    async def result(self):
        return SimpleNamespace(prefill=self.prefill, num_cached_tokens=3)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for event in self.events:
            yield event
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


def ev(index: int, text: str, n: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(index=index, token_id=5, token_text=text, logprob=-1.0, special=False, text_delta=text,
                      generated_tokens=n, finish_reason=finish)


@pytest.fixture(autouse=True)
def no_runtime(monkeypatch):
    """No app is serving: metrics are not recorded (the state only holds the drain, never started)."""
    monkeypatch.setattr(generation, "record_success", lambda *args: None)
    monkeypatch.setattr(generation, "record_failure", lambda exc: None)
    token = runtime.bind(runtime.ServerState(settings=Settings(), engine=None))
    yield
    runtime.unbind(token)


async def _collect(events) -> list:
    return [item async for item in events]


def _stream(encode, prepared, handles):
    """The events the request path sends for `encode` over these handles (errors in TGI's shape)."""
    gen = generation.Generation(started_at=0.0, context=prepared, handles=handles)
    return generation._events(None, common.ERROR_POLICY, encode, gen)


def _chat(handle, n=1, using_tools=False, include_usage=False, logprobs=False):
    parser = partial(ChatOutputParser, forced_json=using_tools)
    turn = PreparedTurn([1] * 7, None, None, "forced_json" if using_tools else "none", ChatMarkers(None, None),
                        parser)
    prepared = chat.PreparedChat(meta=META, turn=turn, num_prompt_tokens=7, n=n, logprobs=logprobs,
                                 include_usage=include_usage)
    return chat._chat_stream, prepared, [handle]


async def test_chat_stream_n_choices_roles_first_then_interleaved_with_usage_and_done():
    events = [ev(0, "a", 1), ev(1, "b", 1), ev(1, "", 2, FinishReason.EOS_TOKEN), ev(0, "c", 2, FinishReason.LENGTH)]
    out = await _collect(_stream(*_chat(FakeHandle(events), n=2, include_usage=True)))
    assert out[-1] == common.DONE
    chunks = out[:-1]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    body = [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
            for c in chunks[2:-1]]
    assert body == [(0, {"content": "a"}, None), (1, {"content": "b"}, None), (1, {}, "stop"),
                    (0, {"content": "c"}, "length")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == shape.usage(7, 4, 3)
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_chat_stream_tool_call_deltas():
    answer = '{"name": "f", "arguments": {"x": 1}}'
    pieces = [answer[:12], answer[12:30], answer[30:]]
    events = [ev(0, p, i + 1, FinishReason.GRAMMAR if i == 2 else None) for i, p in enumerate(pieces)]
    out = await _collect(_stream(*_chat(FakeHandle(events), using_tools=True)))
    deltas = [c["choices"][0]["delta"] for c in out[1:-1]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "f" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"x": 1}
    assert out[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_chat_stream_error_is_one_event_then_done():
    handle = FakeHandle([ev(0, "a", 1)], error=GenerationError("CUDA out of memory"))
    out = await _collect(_stream(*_chat(handle)))
    assert out[-1] == common.DONE
    assert out[-2] == {"error": "Request failed during generation: CUDA out of memory", "error_type": "generation"}
    assert handle.cancelled


async def test_chat_stream_that_ends_early_is_incomplete():
    out = await _collect(_stream(*_chat(FakeHandle([ev(0, "a", 1)]))))
    assert out[-2]["error_type"] == "incomplete_generation" and out[-1] == common.DONE


async def test_completion_stream_several_prompts_echo_and_logprobs():
    """Each choice starts with its echoed prompt, carrying the prompt's logprobs as the JSON answer does."""
    handles = [FakeHandle([ev(0, " x", 1, FinishReason.LENGTH)], prefill=[PrefillToken(1, "A", None)]),
               FakeHandle([ev(0, " y", 1, FinishReason.EOS_TOKEN)],
                          prefill=[PrefillToken(2, "B", None), PrefillToken(2, "B", -0.5)])]
    prepared = completions.PreparedCompletion(prompts=["A", "BB"], prompt_lengths=[1, 2], meta=META,
                                              n=1, echo=True, logprobs=0, include_usage=True)
    out = await _collect(_stream(completions._completion_stream, prepared, handles))
    assert out[-1] == common.DONE
    choices = [c["choices"][0] for c in out[:-2]]
    by_index = {i: [c for c in choices if c["index"] == i] for i in (0, 1)}
    assert [(c["text"], c["finish_reason"]) for c in by_index[0]] == [("A", None), (" x", "length")]
    assert [(c["text"], c["finish_reason"]) for c in by_index[1]] == [("BB", None), (" y", "stop")]
    assert by_index[1][0]["logprobs"] == {"tokens": ["B", "B"], "token_logprobs": [None, -0.5],
                                          "top_logprobs": [None, None], "text_offset": [0, 1]}
    assert by_index[0][0]["logprobs"]["token_logprobs"] == [None]
    offsets = {i: c[1]["logprobs"]["text_offset"] for i, c in by_index.items()}
    assert offsets == {0: [1], 1: [2]}
    assert out[-2]["usage"] == shape.usage(3, 2, 6)
    assert all(h.cancelled for h in handles)
