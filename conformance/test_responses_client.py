"""OpenAI's Responses API against a live server through the official `openai` SDK, used unchanged:
`responses.create` plain and streamed, with a function tool, `previous_response_id`, `retrieve`,
`delete` and the `responses.stream` helper.

The session's `live_server` runs the tiny random-weight Llama (SmolLM2's tokenizer and chat
template): these tests check shapes, counts, events and determinism, not the words. The slow test
asks the real default model (SmolLM2-135M-Instruct) a question.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

torch.set_num_threads(1)

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=120)
    # The plain and streamed answers compared below are both served from the prefix cache (in
    # bfloat16 a prompt computed in full and one continued from cached blocks can differ at near ties).
    client.responses.create(model="gpt-test", input="What is Deep Learning?", instructions="Be brief.",
                            max_output_tokens=1)
    return client


def test_create_plain_and_streamed(client):
    plain = client.responses.create(model="gpt-test", input="What is Deep Learning?", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert plain.object == "response" and plain.status in ("completed", "incomplete")
    assert plain.output_text and plain.usage.output_tokens <= 8
    stream = client.responses.create(model="gpt-test", input="What is Deep Learning?", instructions="Be brief.",
                                     max_output_tokens=8, temperature=0, stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == f"response.{plain.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert events[-1].response.output_text == plain.output_text


def test_function_tool_round_trip_streamed(client):
    with client.responses.stream(model="gpt-test", input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=60, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        called = stream.get_final_response()
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and "".join(deltas) == call.arguments
    assert json.loads(call.arguments)["city"] in ("Paris", "Lyon")
    answered = client.responses.create(model="gpt-test", previous_response_id=called.id, tools=[WEATHER],
                                       input=[{"type": "function_call_output", "call_id": call.call_id,
                                               "output": json.dumps({"temperature": "18C"})}],
                                       max_output_tokens=8, temperature=0)
    assert answered.previous_response_id == called.id and answered.status in ("completed", "incomplete")
    assert answered.usage.input_tokens > called.usage.input_tokens


def test_function_tool_plain(client):
    called = client.responses.create(model="gpt-test", input="Weather?", tools=[WEATHER], max_output_tokens=60,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.call_id and json.loads(call.arguments)["city"] in ("Paris", "Lyon")


def test_previous_response_id_retrieve_and_delete(client):
    first = client.responses.create(model="gpt-test", input="Tell me about the sea", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model="gpt-test", input="And rivers?", instructions="Be brief.",
                                     previous_response_id=first.id, max_output_tokens=8, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first prompt, from the prefix cache
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-test", input="x", previous_response_id=first.id)


def test_bad_input_is_the_sdks_typed_error(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="gpt-test", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "auto"}]}])
    assert refused.value.body["type"] == "invalid_request_error" and "not supported" in refused.value.message


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_server):
    base = default_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.responses.create(model="tgi", input="What is the capital of France? Answer in one sentence.",
                                  max_output_tokens=30, temperature=0)
    follow_up = client.responses.create(model="tgi", input="And of Italy?", previous_response_id=out.id,
                                        max_output_tokens=30, temperature=0)
    with client.responses.stream(model="tgi", input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=60, temperature=0) as stream:
        called = stream.get_final_response()
    assert "Paris" in out.output_text
    assert follow_up.usage.input_tokens_details.cached_tokens > 0 and follow_up.output_text
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Lyon")
