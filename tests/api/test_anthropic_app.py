"""POST /v1/messages and /v1/messages/count_tokens on the real app over the tiny Llama: answers and
stream events validated with the `anthropic` SDK's own types, bad input as Anthropic's 400s."""

from __future__ import annotations

import json

import pydantic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from transformers import AutoTokenizer

STREAM_EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"name": "get_weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"], "additionalProperties": False}}


MAX_INPUT, MAX_TOTAL = 192, 256  # room for tools in the prompt


@pytest.fixture(scope="module")
def client(tiny_llama):
    """The real app over the tiny Llama with room for tool prompts (conftest's `client` has 40 tokens)."""
    from opentgi.api.app import create_app
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine

    settings = Settings(model_id=str(tiny_llama), device="cpu", max_input_tokens=MAX_INPUT,
                        max_total_tokens=MAX_TOTAL, max_batch_total_tokens=2048)
    with create_app(settings, Engine.from_settings(settings)).test_client() as test_client:
        # Greedy answers are compared between requests: the prompt's prefix goes into the prefix cache
        # first, so every compared request continues from the same cached blocks.
        test_client.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": HI})
        yield test_client


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each `event: NAME\\ndata: {json}` event."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def post(client, **body):
    return client.post("/v1/messages", json={"model": "claude-test", "max_tokens": 6, "messages": HI, **body},
                       headers={"anthropic-version": "2023-06-01"})


def test_message_shape_and_usage(client, tiny_llama):
    response = post(client, temperature=0)
    assert response.status_code == 200
    assert response.json()["stop_sequence"] is None  # present, as Anthropic always sends it
    message = Message.model_validate(response.json())
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=True)
    assert message.usage.input_tokens == len(prompt)
    assert 1 <= message.usage.output_tokens <= 6
    again = Message.model_validate(post(client, temperature=0).json())
    assert again.content == message.content  # greedy


def test_stream_events_in_anthropic_order(client):
    plain = Message.model_validate(post(client, temperature=0).json())
    response = post(client, temperature=0, stream=True)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    for name, data in events:  # every event parses as the SDK's (which skips `ping` by name)
        assert data["type"] == name and (name == "ping" or STREAM_EVENTS.validate_python(data).type == name)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta"}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == plain.content[0].text
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == plain.stop_reason
    assert delta["usage"]["output_tokens"] == plain.usage.output_tokens
    assert events[0][1]["message"]["usage"]["input_tokens"] == plain.usage.input_tokens


def test_stop_sequence_is_reported(client):
    plain = Message.model_validate(post(client, temperature=0, max_tokens=20).json()).content[0].text
    words = plain.split()
    if len(words) < 3:
        pytest.fail(f"the tiny model's greedy answer is too short for this test: {plain!r}")
    stop = words[2]
    message = Message.model_validate(post(client, temperature=0, max_tokens=20, stop_sequences=[stop]).json())
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text and plain.startswith(message.content[0].text)
    events = sse_events(post(client, temperature=0, max_tokens=20, stop_sequences=[stop], stream=True).text)
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_forced_tool_use(client):
    response = post(client, max_tokens=60, temperature=0, tools=[WEATHER],
                    tool_choice={"type": "tool", "name": "get_weather"})
    message = Message.model_validate(response.json())
    assert message.stop_reason == "tool_use"
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Lyon")
    events = sse_events(post(client, max_tokens=60, temperature=0, tools=[WEATHER], tool_choice={"type": "any"},
                                 stream=True).text)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_weather"
    arguments = "".join(d["delta"]["partial_json"] for n, d in events
                        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(arguments)["city"] in ("Paris", "Lyon")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_count_tokens_matches_the_message_prompt(client):
    counted = client.post("/v1/messages/count_tokens", json={"model": "m", "messages": HI, "system": "Be brief."})
    assert counted.status_code == 200
    used = Message.model_validate(post(client, system="Be brief.").json()).usage.input_tokens
    assert MessageTokensCount.model_validate(counted.json()).input_tokens == used


@pytest.mark.parametrize("body, message", [
    ({"messages": HI}, "max_tokens"),  # required
    ({"max_tokens": 0, "messages": HI}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]},
     "`image` content blocks are not supported"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": {"type": "any"}}, "tool_choice: `any` needs `tools`"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 300}]}, "prompt is too long"),
    ({"max_tokens": 250, "messages": HI}, "prompt tokens + max_tokens must be <="),
    ({"max_tokens": 5, "messages": HI, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role"),
])
def test_bad_requests_get_anthropic_400s(client, body, message):
    response = client.post("/v1/messages", json={"model": "m", **body})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


def test_a_body_that_is_not_json_is_an_anthropic_400(client):
    response = client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_output_config_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    message = Message.model_validate(post(client, max_tokens=30, temperature=0, output_config={
        "effort": "low", "format": {"type": "json_schema", "schema": schema}}).json())
    assert isinstance(json.loads(message.content[0].text)["ok"], bool)
