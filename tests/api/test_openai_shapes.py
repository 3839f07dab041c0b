"""Engine results -> OpenAI response objects (opentgi.api.openai.shapes), checked against the
response schemas of openapi/tgi.json."""

from __future__ import annotations

import json

import pytest

from opentgi.api.chat import ChatOutputParser
from opentgi.api.openai import shapes as shape
from opentgi.engine.events import PrefillToken, SequenceResult, TokenEvent, TopToken
from opentgi.engine.request import FinishReason
from tests.helpers.openapi import documents, oas30_validator

TGI = documents()["tgi.json"]
META = shape.ResponseMeta(id="chatcmpl-1", created=1700000000, model="m")


def FORCED_JSON():  # noqa: N802 - a parser factory, as PreparedTurn.make_parser
    return ChatOutputParser(forced_json=True)


def _validate(schema_name: str, value: dict) -> None:
    oas30_validator(TGI, {"$ref": f"#/components/schemas/{schema_name}"}).validate(value)


def _event(text: str, lp: float = -0.5, finish: FinishReason | None = None, index: int = 0, n: int = 1):
    return TokenEvent(index=index, token_id=1, token_text=text, logprob=lp, special=False, text_delta=text,
                      generated_tokens=n, top_tokens=[TopToken(id=1, text=text, logprob=lp, special=False),
                                                      TopToken(id=2, text="x", logprob=-3.0, special=False)],
                      finish_reason=finish)


def _seq(text: str, reason=FinishReason.EOS_TOKEN, index: int = 0) -> SequenceResult:
    tokens = [_event(text, finish=reason, index=index)]
    return SequenceResult(index=index, token_ids=[1], text=text, finish_reason=reason, seed=None, tokens=tokens)


@pytest.mark.parametrize("reason,expected", [
    (FinishReason.EOS_TOKEN, "stop"), (FinishReason.STOP_SEQUENCE, "stop"), (FinishReason.GRAMMAR, "stop"),
    (FinishReason.LENGTH, "length"), (FinishReason.CONTEXT, "length"), (FinishReason.SENSITIVE, "content_filter"),
])
def test_finish_reasons_are_openai_values(reason, expected):
    assert shape.finish_reason(reason) == expected


def test_chat_completion_text_with_logprobs():
    out = shape.chat_completion(META, [_seq("Hi", index=1), _seq("Yo")], 10, make_parser=ChatOutputParser, logprobs=True)
    _validate("ChatCompletion", out)
    assert out["object"] == "chat.completion" and [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Yo"}
    assert out["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] == {"token": "x", "logprob": -3.0}
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}


def test_chat_completion_tool_call_arguments_are_a_json_string():
    answer = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    out = shape.chat_completion(META, [_seq(answer, FinishReason.GRAMMAR)], 3, make_parser=FORCED_JSON, logprobs=False)
    _validate("ChatCompletion", out)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_chat_tool_answer_as_text_and_cut_short():
    text = shape.chat_completion(META, [_seq('{"content": "no tool"}')], 3, make_parser=FORCED_JSON, logprobs=False)
    assert text["choices"][0]["message"]["content"] == "no tool"
    assert text["choices"][0]["finish_reason"] == "stop"
    def cut(text):
        out = shape.chat_completion(META, [_seq(text, FinishReason.LENGTH)], 3, make_parser=FORCED_JSON, logprobs=False)
        assert out["choices"][0]["finish_reason"] == "length"
        return out["choices"][0]["message"]

    assert cut('{"name": "f", "argu')["content"] == '{"name": "f", "argu'
    assert cut('{"content": "Hel\\u00e9 wor')["content"] == "Hel\u00e9 wor"
    call = cut('{"name": "f", "arguments": {"a": [1, 2')["tool_calls"][0]
    assert call["function"] == {"name": "f", "arguments": '{"a": [1, 2'}


def test_chat_chunks_match_the_document():
    first = shape.chat_chunk(META, [shape.chat_choice_delta(0, {"role": "assistant", "content": ""})],
                             include_usage=True)
    piece = shape.chat_chunk(META, [shape.chat_choice_delta(
        0, {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}, finish="tool_calls",
        logprob_events=[_event("{")])], include_usage=False)
    usage = shape.chat_chunk(META, [], include_usage=True, usage_value=shape.usage(3, 4))
    for chunk in (first, piece, usage):
        _validate("ChatCompletionChunk", chunk)
        assert chunk["object"] == "chat.completion.chunk"
    assert first["usage"] is None and "usage" not in piece and usage["usage"]["total_tokens"] == 7


def test_completion_logprobs_with_echo():
    builder = shape.CompletionLogprobs(0)
    prompt = builder.prompt([PrefillToken(id=1, text="Hel", logprob=None), PrefillToken(id=2, text="lo", logprob=-1.0)])
    generated = builder.tokens([_event(" you")])
    merged = shape.merge_logprobs([prompt, generated])
    assert merged["tokens"] == ["Hel", "lo", " you"]
    assert merged["token_logprobs"] == [None, -1.0, -0.5]
    assert merged["top_logprobs"] == [None, None, {" you": -0.5, "x": -3.0}]
    assert merged["text_offset"] == [0, 3, 5]
    choice = shape.completion_choice(0, "Hello you", "stop", merged)
    full = shape.completion(META, [choice], shape.usage(2, 1))
    _validate("CompletionFinal", full)
    chunk = shape.completion_chunk(META, [shape.completion_choice(0, " you", None, None)], include_usage=True)
    _validate("Chunk", chunk)
    assert full["object"] == chunk["object"] == "text_completion"


def test_completion_logprobs_without_top():
    builder = shape.CompletionLogprobs(5, with_top=False)
    out = builder.tokens([_event("a"), _event("bc")])
    assert out["top_logprobs"] == [None, None] and out["text_offset"] == [5, 6]
