"""Tool choice, TGI's forced-JSON tool grammar and parsing its constrained answer
(opentgi.api.chat.tools, opentgi.api.chat.forced_json)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from opentgi.api.chat.forced_json import ToolAnswerStream, parse_tool_answer, tool_grammar_schema
from opentgi.api.chat.tools import ToolError, select_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
        "required": ["city"], "$defs": {"unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_choice_forms():
    assert select_tools(None, None).mode == "none"
    assert select_tools([WEATHER], None).mode == "auto"
    assert select_tools([WEATHER], "none").mode == "none"
    assert select_tools([WEATHER, TIME], "required").mode == "required"
    named = select_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.tools == [TIME]
    assert select_tools([WEATHER, TIME], "get_weather").tools == [WEATHER]
    assert select_tools([WEATHER], {}).mode == "auto"


@pytest.mark.parametrize("tools,choice,match", [
    ([WEATHER], "nope", "not found"),
    (None, "required", "requires `tools`"),
    ([WEATHER, WEATHER], "auto", "unique"),
    ([{"type": "retrieval"}], "auto", "function"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": 5}}], "auto", "JSON schema object"),
])
def test_tool_choice_errors(tools, choice, match):
    with pytest.raises(ToolError, match=match):
        select_tools(tools, choice)


def test_grammar_schema_accepts_calls_and_rejects_others():
    schema = tool_grammar_schema(select_tools([WEATHER, TIME], "required"))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}},
                {"content": "hi"}, {"name": "get_weather", "arguments": {"city": "P", "unit": "k"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_auto_allows_a_text_answer():
    schema = tool_grammar_schema(select_tools([WEATHER], "auto"))
    jsonschema.validate({"content": "no tool needed"}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)


def test_parse_answer():
    call = parse_tool_answer('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert call.is_call and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    text = parse_tool_answer('{"content": "Hello \\"you\\""}')
    assert not text.is_call and text.content == 'Hello "you"'
    assert parse_tool_answer('{"name": "get_weather", "argu') is None


def _run_stream(pieces):
    stream = ToolAnswerStream()
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    return deltas


def test_stream_call_arguments_concatenate_to_json():
    answer = '{"name": "get_weather", "arguments":  {"city": "Pa}ris", "opts": {"a": [1, {}]}} }'
    for size in (1, 2, 3, 7):
        deltas = _run_stream([answer[i:i + size] for i in range(0, len(answer), size)])
        assert deltas[0].kind == "call" and deltas[0].text == "get_weather"
        assert all(d.kind == "arguments" for d in deltas[1:])
        args = "".join(d.text for d in deltas[1:])
        assert args == args.strip()
        assert json.loads(args) == {"city": "Pa}ris", "opts": {"a": [1, {}]}}


def test_stream_text_answer_decodes_escapes_incrementally():
    answer = '{"content": "caf\\u00e9 \\ud83d\\ude00 \\"q\\"\\n"}'
    for size in (1, 3, 5):
        deltas = _run_stream([answer[i:i + size] for i in range(0, len(answer), size)])
        assert all(d.kind == "content" for d in deltas)
        assert "".join(d.text for d in deltas) == 'café 😀 "q"\n'


def test_stream_cut_short_shows_raw_text():
    deltas = _run_stream(['{"na'])
    assert [(d.kind, d.text) for d in deltas] == [("content", '{"na')]


def test_tgi_arguments_alias_for_parameters():
    tgi_tool = {"type": "function", "function": {"name": "f", "arguments": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    schema = tool_grammar_schema(select_tools([tgi_tool], "required"))
    jsonschema.validate({"name": "f", "arguments": {"x": 1}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {}}, schema)
