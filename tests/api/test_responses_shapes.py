"""OpenAI Responses: input items in OpenAI chat form, the store, output items and the numbered
stream events, the error shape (pure functions; the app-level tests are in test_responses_app.py)."""

from __future__ import annotations

import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from opentgi.api.chat import ReasoningDelta, TextDelta, ToolCall, ToolCallArguments, ToolCallStart
from opentgi.api.errors import UnauthorizedError
from opentgi.api.responses import items as convert
from opentgi.api.responses import output as shapes
from opentgi.api.responses.errors import ResponseNotFoundError, openai_error
from opentgi.api.responses.store import ResponseStore, StoredResponse
from opentgi.api.responses.stream import ResponseEvents
from opentgi.engine.errors import InputTooLongError, NotSupportedError, OverloadedError, ValidationError
from opentgi.schemas import openai_responses as schema

SDK_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def request(**fields) -> schema.CreateResponseRequest:
    return schema.CreateResponseRequest.model_validate(fields)


def test_string_input_is_one_user_message():
    assert convert.input_messages(request(input="Hi").input) == [{"role": "user", "content": "Hi"}]


def test_items_become_chat_messages():
    req = request(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20C"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Both mild.", "annotations": []}]},
    ])
    assert convert.input_messages(req.input) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
        {"role": "assistant", "content": "Both mild."}]


def test_images_files_and_other_tools_are_refused():
    req = request(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    with pytest.raises(NotSupportedError, match="`input_image` content is not supported"):
        convert.input_messages(req.input)
    with pytest.raises(NotSupportedError, match="only `function` tools"):
        convert.chat_tools(request(tools=[{"type": "web_search"}]).tools)


def test_tools_tool_choice_and_text_format():
    tools = convert.chat_tools(request(tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}]).tools)
    assert tools == [{"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}]
    assert convert.chat_tool_choice(None, tools) == "auto"
    assert convert.chat_tool_choice(request(tool_choice="required").tool_choice, tools) == "required"
    named = request(tool_choice={"type": "function", "name": "f"}).tool_choice
    assert convert.chat_tool_choice(named, tools) == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ValidationError, match="no function tool is named 'g'"):
        convert.chat_tool_choice(request(tool_choice={"type": "function", "name": "g"}).tool_choice, tools)
    schema_format = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}
    assert convert.response_format(request(text={"format": schema_format}).text) == {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}}
    assert convert.response_format(request(text={"format": {"type": "text"}}).text) is None
    with pytest.raises(ValidationError, match="needs `schema`"):
        convert.response_format(request(text={"format": {"type": "json_schema", "name": "x"}}).text)


def test_store_is_bounded_least_recently_used_out():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", StoredResponse({"id": "c"}))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    nothing = ResponseStore(0)
    nothing.put("a", StoredResponse({"id": "a"}))
    assert nothing.get("a") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_output_items():
    items = shapes.output_items("hmm", "", [ToolCall("call_1", "f", "{}")], incomplete=False)
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[1]["call_id"] == "call_1" and items[1]["id"].startswith("fc_")
    (message,) = shapes.output_items("", "", [], incomplete=True)
    assert message["status"] == "incomplete" and message["content"][0]["text"] == ""


def meta() -> shapes.ResponseMeta:
    return shapes.ResponseMeta(model="m", echo=shapes.request_echo(request(input="x"), None))


def test_stream_events_are_numbered_and_parse_as_the_sdks():
    events = ResponseEvents(meta())
    pieces = [ReasoningDelta("think"), TextDelta("Hi"), TextDelta("!"), ToolCallStart(0, "call_1", "f"),
              ToolCallArguments(0, '{"a":'), ToolCallArguments(0, "1}")]
    stream = events.start() + [e for p in pieces for e in events.feed(p)] + events.finish(False, shapes.usage(5, 0, 9, 1))
    assert [e.data["sequence_number"] for e in stream] == list(range(len(stream)))
    for event in stream:
        assert event.name == event.data["type"] and SDK_EVENTS.validate_python(event.data).type == event.name
    names = [e.name for e in stream]
    assert names == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = stream[-1].data["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hi!" and final["output"][2]["arguments"] == '{"a":1}'
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 14
    added = [e.data for e in stream if e.name == "response.output_item.added"]
    assert [a["output_index"] for a in added] == [0, 1, 2]
    assert [a["item"]["id"] for a in added] == [i["id"] for i in final["output"]]


def test_an_empty_answer_still_has_a_message_and_a_cut_one_is_incomplete():
    events = ResponseEvents(meta())
    stream = events.start() + events.finish(True, shapes.usage(5, 0, 3, 0))
    assert stream[-1].name == "response.incomplete"
    final = stream[-1].data["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["type"] == "message" and final["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize("exc, status, error_type, code", [
    (ValidationError("bad"), 400, "invalid_request_error", None),
    (InputTooLongError("long", input_tokens=9, max_new_tokens=1, limit=8), 400, "invalid_request_error",
     "context_length_exceeded"),
    (UnauthorizedError(), 401, "authentication_error", "invalid_api_key"),
    (ResponseNotFoundError("resp_x"), 404, "not_found_error", None),
    (OverloadedError("busy"), 429, "rate_limit_error", "rate_limit_exceeded"),
    (RuntimeError("bug"), 500, "server_error", None),
])
def test_error_shape(exc, status, error_type, code):
    shape = openai_error(exc)
    assert shape.status == status
    assert shape.body["error"]["type"] == error_type and shape.body["error"]["code"] == code
    assert set(shape.body["error"]) == {"message", "type", "param", "code"}


def test_the_store_size_flag():
    from opentgi.cli import build_parser, settings_from

    assert settings_from(build_parser().parse_args(["serve", "--responses-store-size", "5"]), {}) \
        .responses_store_size == 5
    assert settings_from(build_parser().parse_args(["serve"]), {"RESPONSES_STORE_SIZE": "7"}).responses_store_size == 7
    with pytest.raises(SystemExit, match="--responses-store-size must be 0 or more"):
        settings_from(build_parser().parse_args(["serve", "--responses-store-size", "-1"]), {})


def test_a_stream_error_event_takes_the_next_number():
    from types import SimpleNamespace

    from opentgi.api.responses.errors import error_event
    from opentgi.engine.errors import GenerationError

    events = ResponseEvents(meta())
    sent = events.start()
    error = error_event(GenerationError("boom"), SimpleNamespace(context=SimpleNamespace(sequence=events.sequence)))
    assert error.name == "error" and error.data["sequence_number"] == len(sent)
    assert SDK_EVENTS.validate_python(error.data).message == "boom"
