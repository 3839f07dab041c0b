"""Thinking and native tool calls in the Anthropic Messages and OpenAI Responses shapes, through the
whole engine path on the tiny model whose template thinks (`<think>`) and calls tools the Hermes way
(`<tool_call>`). As in test_chat_reasoning_tools.py, the test-only `Writer` (tests/helpers/think_plan.py) plays the model's choice
of when to close the thinking or open a call; every call's JSON is the model's own, through the
engine's lazy grammar."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from tests.helpers.think_plan import CALL, END_THINK, EOS, SCHEMAS, ids

ANTHROPIC_EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
OPENAI_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
QUESTION = "Weather and time in Paris?"
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": SCHEMAS["get_weather"]},
                   {"name": "get_time", "input_schema": SCHEMAS["get_time"]}]
RESPONSES_TOOLS = [{"type": "function", "name": name, "parameters": schema} for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def client(app_client):
    return app_client


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def message(client, **body):
    response = client.post("/v1/messages", json={"model": "m", "max_tokens": 150, "messages": [
        {"role": "user", "content": QUESTION}], **body})
    assert response.status_code == 200, response.text
    return response


def respond(client, **body):
    response = client.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 150, **body})
    assert response.status_code == 200, response.text
    return response


def test_anthropic_thinking_block_then_text(client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "Let me think."), END_THINK, *ids(engine, "\n\nHello there"), EOS]
    out = Message.model_validate(message(client).json())
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == [
        ("thinking", "Let me think."), ("text", "Hello there")]
    assert out.stop_reason == "end_turn"
    plan.tokens = [*ids(engine, "Hmm, ok"), END_THINK, *ids(engine, "Hi"), EOS]
    streamed = events(message(client, stream=True).text)
    deltas = [d["delta"] for n, d in streamed if n == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == "Hmm, ok"
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == "Hi"
    starts = [d["content_block"]["type"] for n, d in streamed if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    for name, data in streamed:
        assert name == "ping" or ANTHROPIC_EVENTS.validate_python(data).type == name


def test_anthropic_thinking_disabled(client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "Plain answer"), EOS]
    out = message(client, thinking={"type": "disabled"}).json()
    assert out["content"] == [{"type": "text", "text": "Plain answer"}]


def test_anthropic_two_parallel_tool_use_blocks(client, plan):
    plan.tokens = [CALL, CALL, EOS]
    out = Message.model_validate(message(client, tools=ANTHROPIC_TOOLS, thinking={"type": "disabled"}).json())
    calls = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and len(calls) == 2 and len({c.id for c in calls}) == 2
    for call in calls:
        jsonschema.validate(call.input, SCHEMAS[call.name])
    plan.tokens = [CALL, CALL, EOS]
    streamed = events(message(client, tools=ANTHROPIC_TOOLS, thinking={"type": "disabled"}, stream=True).text)
    starts = [(d["index"], d["content_block"]) for n, d in streamed if n == "content_block_start"]
    assert [block["type"] for _, block in starts] == ["tool_use", "tool_use"]
    for index, block in starts:
        partial = "".join(d["delta"]["partial_json"] for n, d in streamed
                          if n == "content_block_delta" and d["index"] == index)
        jsonschema.validate(json.loads(partial), SCHEMAS[block["name"]])
    plan.tokens = [CALL, CALL, EOS]
    one = message(client, tools=ANTHROPIC_TOOLS, thinking={"type": "disabled"},
                  tool_choice={"type": "auto", "disable_parallel_tool_use": True}).json()
    assert len([b for b in one["content"] if b["type"] == "tool_use"]) == 1


def test_responses_reasoning_item_then_message(client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "Let me think."), END_THINK, *ids(engine, "\n\nHello there"), EOS]
    out = Response.model_validate(respond(client).json())
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == "Let me think." and out.output_text == "Hello there"
    assert out.usage.output_tokens_details.reasoning_tokens == len(ids(engine, "Let me think."))  # the text
    plan.tokens = [*ids(engine, "Hmm, ok"), END_THINK, *ids(engine, "Hi"), EOS]
    streamed = events(respond(client, stream=True).text)
    for name, data in streamed:
        assert OPENAI_EVENTS.validate_python(data).type == name
    assert "".join(d["delta"] for n, d in streamed if n == "response.reasoning_text.delta") == "Hmm, ok"
    assert "".join(d["delta"] for n, d in streamed if n == "response.output_text.delta") == "Hi"
    final = streamed[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]


def test_responses_effort_none_turns_thinking_off(client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "Plain answer"), EOS]
    out = Response.model_validate(respond(client, reasoning={"effort": "none"}).json())
    assert [item.type for item in out.output] == ["message"] and out.output_text == "Plain answer"


def test_responses_two_parallel_function_calls_and_the_round_trip(client, plan):
    plan.tokens = [CALL, CALL, EOS]
    out = Response.model_validate(respond(client, tools=RESPONSES_TOOLS, reasoning={"effort": "none"}).json())
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 2 and len({c.call_id for c in calls}) == 2
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    plan.tokens = [EOS]
    follow_up = respond(client, previous_response_id=out.id, tools=RESPONSES_TOOLS, reasoning={"effort": "none"},
                        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls])
    assert follow_up.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    plan.tokens = [CALL, CALL, EOS]
    streamed = events(respond(client, tools=RESPONSES_TOOLS, reasoning={"effort": "none"}, stream=True).text)
    added = [d["item"] for n, d in streamed if n == "response.output_item.added"]
    assert [item["type"] for item in added] == ["function_call", "function_call"]
    done = [d for n, d in streamed if n == "response.function_call_arguments.done"]
    assert [d["output_index"] for d in done] == [0, 1]
    plan.tokens = [CALL, CALL, EOS]
    one = respond(client, tools=RESPONSES_TOOLS, reasoning={"effort": "none"}, parallel_tool_calls=False).json()
    assert len([item for item in one["output"] if item["type"] == "function_call"]) == 1
