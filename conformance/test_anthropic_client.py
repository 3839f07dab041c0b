"""Anthropic's Messages API against a live server through the official `anthropic` SDK, used
unchanged: `messages.create`, `messages.stream`, a tool round trip and `messages.count_tokens`.

The session's `live_server` runs the tiny random-weight Llama (SmolLM2's tokenizer and chat
template): these tests check shapes, counts, events and determinism, not the words. The slow test
asks the real default model (SmolLM2-135M-Instruct) a question.
"""

from __future__ import annotations

import json

import anthropic
import pytest
import torch

torch.set_num_threads(1)

# The SDK's typed arguments no longer include the sampling parameters the API still takes.
GREEDY = {"temperature": 0}
HI = [{"role": "user", "content": "What is Deep Learning?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(live_server) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=live_server, api_key="unused", max_retries=0, timeout=120)
    # Greedy answers are compared between requests: each prompt's prefix first goes into the prefix
    # cache, so that every compared request is served from it alike (in bfloat16 a prompt computed
    # in full and one continued from cached blocks can differ at near ties).
    for system in (None, "Be brief."):
        client.messages.create(model="claude-test", max_tokens=1, messages=HI,
                               **({"system": system} if system else {}))
    return client


def test_messages_create(client):
    message = client.messages.create(model="claude-test", max_tokens=8, messages=HI, extra_body=GREEDY,
                                     system="Be brief.", metadata={"user_id": "u1"})
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= 8 and message.usage.input_tokens > 0
    again = client.messages.create(model="claude-test", max_tokens=8, messages=HI, extra_body=GREEDY, system="Be brief.")
    assert again.content[0].text == message.content[0].text


def test_messages_stream_gives_the_same_message(client):
    plain = client.messages.create(model="claude-test", max_tokens=8, messages=HI, extra_body=GREEDY)
    with client.messages.stream(model="claude-test", max_tokens=8, messages=HI, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_tool_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model="claude-test", max_tokens=60, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Lyon")
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]}]
    with client.messages.stream(model="claude-test", max_tokens=8, messages=messages, tools=[WEATHER],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model="claude-test", messages=messages, tools=[WEATHER])
    assert counted.input_tokens == final.usage.input_tokens


def test_streamed_tool_use_has_its_input(client):
    with client.messages.stream(model="claude-test", max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    (call,) = [block for block in final.content if block.type == "tool_use"]
    assert call.input["city"] in ("Paris", "Lyon") and final.stop_reason == "tool_use"


def test_structured_output(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    message = client.messages.create(model="claude-test", max_tokens=30, messages=HI, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(message.content[0].text)["ok"], bool)


def test_count_tokens(client):
    counted = client.messages.count_tokens(model="claude-test", messages=HI, system="Be brief.")
    used = client.messages.create(model="claude-test", max_tokens=1, messages=HI, system="Be brief.")
    assert counted.input_tokens == used.usage.input_tokens


def test_errors_are_the_sdks_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="claude-test", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "not supported" in refused.value.body["error"]["message"]


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_server):
    base = default_server
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)
    with client.messages.stream(model="claude-test", max_tokens=30, extra_body=GREEDY, messages=question) as stream:
        streamed = "".join(stream.text_stream)
    # asked again, the prompt comes from the prefix cache: batch-invariant serving gives the same answer
    message = client.messages.create(model="claude-test", max_tokens=30, extra_body=GREEDY, messages=question)
    counted = client.messages.count_tokens(model="claude-test", messages=question)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(model="claude-test", max_tokens=60, messages=ask, tools=[WEATHER],
                                    tool_choice={"type": "any"}, extra_body=GREEDY)
    (call,) = [block for block in called.content if block.type == "tool_use"]
    ask += [{"role": "assistant", "content": called.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C, sunny"}]}]
    with client.messages.stream(model="claude-test", max_tokens=30, messages=ask, tools=[WEATHER],
                                extra_body=GREEDY) as stream:
        answered = stream.get_final_message()
    assert "Paris" in streamed
    assert message.content[0].type == "text" and counted.input_tokens == message.usage.input_tokens
    assert message.content[0].text == streamed
    assert called.stop_reason == "tool_use" and call.input["city"] in ("Paris", "Lyon")
    assert answered.stop_reason in ("end_turn", "max_tokens", "tool_use") and answered.content
