"""Anthropic Messages: the request in OpenAI chat form, the content blocks and their stream events,
the error shape (pure functions; the app-level tests are in test_anthropic_app.py)."""

from __future__ import annotations

import pytest

from opentgi.api.anthropic import blocks
from opentgi.api.anthropic import messages as convert
from opentgi.api.anthropic.errors import anthropic_error, error_event
from opentgi.api.chat import ReasoningDelta, TextDelta, ToolCall, ToolCallArguments, ToolCallStart
from opentgi.api.errors import PayloadTooLargeError, UnauthorizedError
from opentgi.engine.errors import (
    GenerationError,
    InputTooLongError,
    NotSupportedError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)
from opentgi.engine.request import FinishReason
from opentgi.schemas import anthropic as schema

WEATHER = {"name": "get_weather", "description": "Weather now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields) -> schema.MessagesRequest:
    return schema.MessagesRequest.model_validate({"model": "m", "max_tokens": 50, **fields})


def test_system_and_plain_messages():
    req = request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                  messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert convert.chat_messages(req.system, req.messages) == [
        {"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "a\nb"}]


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages():
    req = request(system="sys", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call it.", "signature": ""},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "20C"}]},
            {"type": "text", "text": "And tomorrow?"}]}])
    assert convert.chat_messages(req.system, req.messages) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "I should call it.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "20C"},
        {"role": "user", "content": "And tomorrow?"}]


@pytest.mark.parametrize("content", [
    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}],
    [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}],
    [{"type": "document", "source": {"type": "text", "data": "x"}}],
])
def test_images_and_documents_are_refused_by_name(content):
    req = request(messages=[{"role": "user", "content": content}])
    with pytest.raises(NotSupportedError, match="content blocks are not supported: the served model reads text"):
        convert.chat_messages(req.system, req.messages)


def test_blocks_in_the_wrong_role_and_no_messages_are_refused():
    with pytest.raises(ValidationError, match="belong to assistant messages"):
        req = request(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])
        convert.chat_messages(None, req.messages)
    with pytest.raises(ValidationError, match="at least one message"):
        convert.chat_messages(None, [])


def test_tools_and_tool_choice():
    tools = convert.chat_tools(request(messages=[], tools=[WEATHER]).tools)
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                       "parameters": WEATHER["input_schema"]}}]
    choice = request(messages=[], tool_choice={"type": "any", "disable_parallel_tool_use": True}).tool_choice
    assert convert.chat_tool_choice(choice, tools) == ("required", False)
    choice = request(messages=[], tool_choice={"type": "tool", "name": "get_weather"}).tool_choice
    assert convert.chat_tool_choice(choice, tools) == ({"type": "function", "function": {"name": "get_weather"}}, True)
    assert convert.chat_tool_choice(request(messages=[], tool_choice={"type": "none"}).tool_choice, tools) == ("none", True)
    assert convert.chat_tool_choice(None, tools) == ("auto", True)
    assert convert.chat_tool_choice(None, None) == (None, True)
    with pytest.raises(ValidationError, match="no tool is named 'nope'"):
        convert.chat_tool_choice(request(messages=[], tool_choice={"type": "tool", "name": "nope"}).tool_choice, tools)
    with pytest.raises(ValidationError, match="must be unique"):
        convert.chat_tools(request(messages=[], tools=[WEATHER, WEATHER]).tools)


def test_thinking_config():
    enabled = request(messages=[], thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048).thinking
    assert convert.thinking_options(enabled, 2048) == ({"enable_thinking": True}, 1024)
    with pytest.raises(ValidationError, match="budget_tokens: must be less than max_tokens"):
        convert.thinking_options(enabled, 1024)
    disabled = request(messages=[], thinking={"type": "disabled"}).thinking
    assert convert.thinking_options(disabled, 10) == ({"enable_thinking": False}, None)
    assert convert.thinking_options(None, 10) == (None, None)


def test_sampling_and_stops():
    assert convert.sampling_params(request(messages=[])).do_sample  # Anthropic's default: temperature 1
    assert not convert.sampling_params(request(messages=[], temperature=0)).do_sample
    top = convert.sampling_params(request(messages=[], temperature=0.5, top_p=0.9, top_k=5))
    assert (top.temperature, top.top_p, top.top_k) == (0.5, 0.9, 5)
    with pytest.raises(ValidationError, match="at most 4 stop sequences"):
        convert.stop_sequences(["a", "b", "c", "d", "e"], 4)
    assert convert.matched_stop_sequence(["END", "STOP"], "abc STOP more END") == "STOP"
    assert convert.matched_stop_sequence(["x"], "abc") is None
    with pytest.raises(InputTooLongError, match="prompt is too long"):
        convert.check_lengths(41, 1, 40, 64)


def test_stop_reason_and_message_content():
    assert blocks.stop_reason(FinishReason.EOS_TOKEN, False) == "end_turn"
    assert blocks.stop_reason(FinishReason.EOS_TOKEN, True) == "tool_use"
    assert blocks.stop_reason(FinishReason.LENGTH, True) == "max_tokens"
    assert blocks.stop_reason(FinishReason.STOP_SEQUENCE, False) == "stop_sequence"
    content = blocks.message_content("hmm", "", [ToolCall("toolu_1", "get_weather", '{"city": "Paris"}')])
    assert content == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]
    assert blocks.message_content("", "", []) == [{"type": "text", "text": ""}]


def test_block_stream_opens_and_closes_blocks_as_anthropic_streams_them():
    stream = blocks.BlockStream()
    pieces = [ReasoningDelta("think"), ReasoningDelta("ing"), TextDelta("Hi"), ToolCallStart(0, "toolu_1", "f"),
              ToolCallArguments(0, '{"a":'), ToolCallArguments(0, " 1}"), ToolCallStart(1, "toolu_2", "g")]
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    assert [(e.name, e.data.get("index"), (e.data.get("delta") or e.data.get("content_block") or {}).get("type"))
            for e in events] == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_stop", 3, None)]
    assert events[7].data["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    assert stream.used_tools
    empty = blocks.BlockStream()
    assert [e.name for e in empty.finish()] == ["content_block_start", "content_block_stop"]


@pytest.mark.parametrize("exc, status, error_type", [
    (ValidationError("bad"), 400, "invalid_request_error"),
    (NotSupportedError("no images"), 400, "invalid_request_error"),
    (InputTooLongError("long", input_tokens=9, max_new_tokens=1, limit=8), 400, "invalid_request_error"),
    (UnauthorizedError(), 401, "authentication_error"),
    (PayloadTooLargeError(10), 413, "request_too_large"),
    (OverloadedError("busy"), 529, "overloaded_error"),
    (GenerationError("boom"), 500, "api_error"),
    (UnhealthyError("down"), 503, "api_error"),
    (RuntimeError("bug"), 500, "api_error"),
])
def test_error_shape(exc, status, error_type):
    shape = anthropic_error(exc)
    assert shape.status == status
    assert shape.body == {"type": "error", "error": {"type": error_type, "message": shape.body["error"]["message"]}}
    assert "bug" not in shape.body["error"]["message"]  # no internals leak from unexpected errors
    event = error_event(exc)
    assert event.name == "error" and event.data == shape.body


def test_output_config():
    config = request(messages=[], output_config={"effort": "medium", "format": {
        "type": "json_schema", "schema": {"type": "object"}}}).output_config
    assert convert.output_options(config) == (
        {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}, 4096)
    assert convert.output_options(None) == (None, None)
    assert convert.output_options(request(messages=[], output_config={"effort": "max"}).output_config) == (None, None)
