"""POST /v1/responses, GET and DELETE /v1/responses/{id} on the real app over the tiny Llama: answers
and stream events validated with the `openai` SDK's own types, the store, previous_response_id (its
prompt prefix served by the prefix cache), tools, structured output, bad input as OpenAI's 4xx."""

from __future__ import annotations

import json

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from transformers import AutoTokenizer

SDK_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
MAX_INPUT, MAX_TOTAL, BLOCK = 192, 256, 16
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(tiny_llama):
    """The real app over the tiny Llama with room for follow-ups (conftest's `client` has 40 tokens)."""
    from opentgi.api.app import create_app
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine

    settings = Settings(model_id=str(tiny_llama), device="cpu", max_input_tokens=MAX_INPUT,
                        max_total_tokens=MAX_TOTAL, max_batch_total_tokens=2048, block_size=BLOCK,
                        responses_store_size=8)
    with create_app(settings, Engine.from_settings(settings)).test_client() as test_client:
        # Greedy answers are compared between requests: the prompt's prefix goes into the prefix cache
        # first, so every compared request continues from the same cached blocks.
        test_client.post("/v1/responses", json={"input": "Hello there", "max_output_tokens": 1})
        yield test_client


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def create(client, **body) -> dict:
    response = client.post("/v1/responses", json={"model": "gpt-test", "max_output_tokens": 6, "temperature": 0,
                                                  **body})
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_response_shape_and_usage(client, tokenizer):
    body = create(client, input="Hi", instructions="Be brief.")
    response = Response.model_validate(body)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output[0].type == "message"
    assert response.instructions == "Be brief." and response.max_output_tokens == 6
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=True)
    assert response.usage.input_tokens == len(prompt)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.output_text == response.output[0].content[0].text  # the SDK's convenience property
    assert client.get(f"/v1/responses/{response.id}").json() == body


def test_stream_matches_the_plain_answer(client):
    plain = Response.model_validate(create(client, input="Hello there"))
    streamed = client.post("/v1/responses", json={"input": "Hello there", "max_output_tokens": 6, "temperature": 0,
                                                  "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for name, data in events:
        assert SDK_EVENTS.validate_python(data).type == name
    assert events[0][0] == "response.created" and events[-1][0] == f"response.{plain.status}"
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == plain.output_text
    final = Response.model_validate(events[-1][1]["response"])
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client, tokenizer):
    first = Response.model_validate(create(client, input="Tell me about the sea", instructions="Be brief."))
    second = Response.model_validate(create(client, input="And rivers?", instructions="Be brief.",
                                            previous_response_id=first.id))
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea"},
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And rivers?"}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert second.usage.input_tokens == len(prompt)
    # the first prompt's full blocks are the second's prefix: served by the engine's prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK > 0
    fresh = Response.model_validate(create(client, input="And rivers?", instructions="Be brief."))
    assert fresh.usage.input_tokens_details.cached_tokens < second.usage.input_tokens_details.cached_tokens


def test_store_get_delete(client):
    kept = create(client, input="Hi")["id"]
    deleted = client.delete(f"/v1/responses/{kept}")
    assert deleted.status_code == 200 and deleted.json() == {"id": kept, "object": "response.deleted", "deleted": True}
    for response in (client.get(f"/v1/responses/{kept}"), client.delete(f"/v1/responses/{kept}")):
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    follow_up = client.post("/v1/responses", json={"input": "x", "previous_response_id": kept})
    assert follow_up.status_code == 404 and follow_up.json()["error"]["param"] == "previous_response_id"
    unstored = create(client, input="Hi", store=False)["id"]
    assert client.get(f"/v1/responses/{unstored}").status_code == 404


def test_the_store_keeps_only_the_newest(client):
    ids = [create(client, input="Hi", max_output_tokens=1)["id"] for _ in range(9)]  # the store holds 8
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert client.get(f"/v1/responses/{ids[-1]}").status_code == 200


def test_function_call_round_trip(client):
    called = Response.model_validate(create(client, input="Weather in Paris?", tools=[WEATHER],
                                            tool_choice="required", max_output_tokens=60))
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Lyon")
    answered = Response.model_validate(create(client, previous_response_id=called.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]))
    assert answered.status in ("completed", "incomplete") and answered.previous_response_id == called.id
    streamed = sse_events(client.post("/v1/responses", json={
        "input": "Weather?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 60, "temperature": 0, "stream": True}).text)
    arguments = "".join(d["delta"] for n, d in streamed if n == "response.function_call_arguments.delta")
    (done,) = [d for n, d in streamed if n == "response.function_call_arguments.done"]
    assert done["arguments"] == arguments and json.loads(arguments)["city"] in ("Paris", "Lyon")


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = Response.model_validate(create(client, input="Is water wet?", max_output_tokens=30, text={
        "format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}}))
    assert isinstance(json.loads(out.output_text)["ok"], bool)


@pytest.mark.parametrize("body, status, message", [
    ({}, 400, "a response needs input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/i.png"}]}]}, 400,
     "`input_image` content is not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "only `function` tools"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "word " * 300}, 400, "the input is too long"),
    ({"input": "x", "max_output_tokens": 250}, 400, "input tokens + max_output_tokens must be <="),
    ({"input": "x", "temperature": 3}, 400, "temperature"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, 400, "effort"),
])
def test_bad_requests_get_openai_errors(client, body, status, message):
    response = client.post("/v1/responses", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_a_wrong_method_names_every_method_of_the_path(client):
    """Connexion adds a route per operation and Starlette's 405 named only the first one's methods."""
    response = client.request("PUT", "/v1/responses/resp_1")
    assert response.status_code == 405 and response.headers["allow"] == "DELETE, GET, HEAD"
    assert response.json()["error"]["message"] == "Method Not Allowed"


def test_reasoning_effort_none_and_low_are_accepted(client):
    for effort in ("none", "low", "xhigh"):
        assert create(client, input="Hi", reasoning={"effort": effort})["reasoning"]["effort"] == effort
