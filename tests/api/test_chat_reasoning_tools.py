"""Reasoning and native tool calls through the whole engine path, on a tiny model whose template
thinks (`<think>`) and calls tools the Hermes way (`<tool_call>`): tests/helpers/tiny_models.py
`tiny_think_llama_path`.

A random model writes neither format on its own, so a test-only processor, `Writer` (tests/helpers/think_plan.py), writes a
planned token wherever the model is free (the thinking, between tool calls): it plays the model's
choices of *when* to close the thinking or open a call. What the grammar constrains (every call's
JSON) is the model's own, through the engine's lazy grammar, and everything downstream (the parser,
the OpenAI shapes) sees the engine's real events.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers.think_plan import CALL, END_THINK, EOS, SCHEMAS, TIME, WEATHER, ids


def chat(client, **body):
    body = {"model": "tgi", "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
            "max_tokens": 60, "seed": 0, **body}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def stream_chunks(response) -> list[dict]:
    lines = [line[len("data:"):].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_thinking_opened_by_the_prompt_is_reasoning_content(app_client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "Let me think."), END_THINK, *ids(engine, "\n\nHello there"), EOS]
    message = chat(app_client).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think."
    assert message["content"] == "Hello there"


def test_reasoning_streams_as_its_own_deltas(app_client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "Hmm, ok"), END_THINK, *ids(engine, "Hi"), EOS]
    chunks = stream_chunks(chat(app_client, stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    kinds = [next(iter(d)) for d in deltas if d]
    assert kinds == ["reasoning_content"] * kinds.count("reasoning_content") + ["content"] * kinds.count("content")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm, ok"
    assert "".join(d.get("content") or "" for d in deltas) == "Hi"


def test_enable_thinking_false_from_the_request_and_the_server_default(app_client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "Plain answer"), EOS]
    message = chat(app_client, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Plain answer"}
    settings, _ = think_engine
    settings.chat_template_kwargs = {"enable_thinking": False}
    try:
        message = chat(app_client).json()["choices"][0]["message"]
    finally:
        settings.chat_template_kwargs = None
    assert message == {"role": "assistant", "content": "Plain answer"}


def test_response_format_starts_after_the_thinking(app_client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "not { json at all"), END_THINK]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = chat(app_client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    message = out.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "not { json at all"
    jsonschema.validate(json.loads(message["content"]), schema)


def test_reasoning_budget_forces_the_end_marker(app_client, think_engine):
    """No grammar: the server's budget alone closes the thinking after N tokens (the model is kept
    from closing it itself by a logit bias)."""
    settings, _ = think_engine
    settings.reasoning_budget = 3
    try:
        out = chat(app_client, logprobs=True, max_tokens=6, logit_bias={str(END_THINK): -100}).json()
    finally:
        settings.reasoning_budget = None
    tokens = [t["token"] for t in out["choices"][0]["logprobs"]["content"]]
    assert "</think>" not in tokens[:3] and tokens[3] == "</think>"
    assert out["choices"][0]["message"]["reasoning_content"] == "".join(tokens[:3])


def test_two_tools_two_parallel_calls(app_client, plan):
    plan.tokens = [CALL, CALL, EOS]
    out = chat(app_client, tools=[WEATHER, TIME], max_tokens=150, chat_template_kwargs={"enable_thinking": False}).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 2 and len({c["id"] for c in calls}) == 2
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_parallel_calls_streamed_with_their_index(app_client, plan):
    plan.tokens = [CALL, CALL, EOS]
    chunks = stream_chunks(chat(app_client, tools=[WEATHER, TIME], stream=True, max_tokens=150,
                                chat_template_kwargs={"enable_thinking": False}))
    pieces = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    heads = [p for p in pieces if "id" in p]
    assert [h["index"] for h in heads] == [0, 1]
    for head in heads:
        arguments = "".join(p["function"]["arguments"] for p in pieces if p["index"] == head["index"])
        jsonschema.validate(json.loads(arguments), SCHEMAS[head["function"]["name"]])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_ends_after_one_call(app_client, plan):
    plan.tokens = [CALL, CALL, EOS]
    out = chat(app_client, tools=[WEATHER, TIME], parallel_tool_calls=False,
               chat_template_kwargs={"enable_thinking": False}).json()
    assert len(out["choices"][0]["message"]["tool_calls"]) == 1


def test_tool_choice_required_calls_from_the_first_token_after_thinking(app_client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "I should call"), END_THINK, EOS]
    out = chat(app_client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = out.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "I should call"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_time"])


def test_auto_answer_without_a_call_is_plain_text(app_client, think_engine, plan):
    """Under `auto` a model that does not open a call answers freely: no JSON wrapper."""
    _, engine = think_engine
    plan.tokens = [*ids(engine, "No tool needed."), EOS]
    out = chat(app_client, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}).json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "No tool needed."}
    assert out["choices"][0]["finish_reason"] == "stop"


def test_tgi_tool_prompt_keeps_the_forced_json_contract(app_client):
    out = chat(app_client, tools=[WEATHER], tool_choice="required", tool_prompt="Use a tool:", max_tokens=200,
               seed=1, chat_template_kwargs={"enable_thinking": False}).json()
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])


def test_tool_round_trip_with_reasoning_in_history(app_client, think_engine, plan):
    _, engine = think_engine
    plan.tokens = [*ids(engine, "It is sunny."), EOS]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "call it",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    out = chat(app_client, messages=messages, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    assert out.json()["choices"][0]["message"]["content"] == "It is sunny."


def test_bad_chat_template_kwargs_are_422(app_client):
    response = app_client.post("/v1/chat/completions", json={
        "model": "tgi", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})
    assert response.status_code == 422 and "chat_template_kwargs" in response.json()["error"]
    response = app_client.post("/v1/chat/completions", json={
        "model": "tgi", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"})
    assert response.status_code == 422 and "reasoning_effort" in response.json()["error"]


def test_tool_call_parser_none_gives_tgi_forced_json(app_client, think_engine, plan):
    """`--tool-call-parser none` overrides the template's Hermes format: the answer is TGI's one
    JSON object from the first token."""
    settings, _ = think_engine
    plan.tokens = []
    settings.tool_call_parser = "none"
    try:
        out = chat(app_client, tools=[WEATHER], logprobs=True, max_tokens=4, seed=1,
                   chat_template_kwargs={"enable_thinking": False}).json()
    finally:
        settings.tool_call_parser = None
    assert out["choices"][0]["logprobs"]["content"][0]["token"].startswith("{")


def test_llama3_bare_json_call_opens_the_answer(app_client, think_engine, plan):
    """Llama 3.1's format (`--tool-call-parser llama3_json`): a call written as bare JSON from the
    answer's first token is constrained from there and parsed, `parameters` as the arguments."""
    settings, engine = think_engine
    plan.tokens = [ids(engine, '{"')[0]]
    settings.tool_call_parser = "llama3_json"
    try:
        out = chat(app_client, tools=[WEATHER, TIME], max_tokens=150, chat_template_kwargs={"enable_thinking": False})
    finally:
        settings.tool_call_parser = None
    choice = out.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None


@pytest.mark.parametrize("parallel", [True, False])
def test_mistral_calls_are_one_json_array(app_client, think_engine, plan, parallel):
    """Mistral's format (`--tool-call-parser mistral`): `[TOOL_CALLS]` then every call in one JSON
    array; `parallel_tool_calls: false` allows one."""
    settings, engine = think_engine
    plan.tokens = [ids(engine, "[TOOL_CALLS]")[0]]
    settings.tool_call_parser = "mistral"
    try:
        # the array's end made likely wherever the grammar allows it (else a random model may go on)
        ends = {str(i): 20 for i in ids(engine, "]") + ids(engine, "}]") + ids(engine, "}}]")}
        out = chat(app_client, tools=[WEATHER, TIME], max_tokens=200, parallel_tool_calls=parallel,
                   logit_bias=ends, chat_template_kwargs={"enable_thinking": False})
    finally:
        settings.tool_call_parser = None
    choice = out.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and (len(calls) >= 1 if parallel else len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_without_grammar_support_native_calls_are_unconstrained_and_required_is_refused(app_client, think_engine,
                                                                                         plan):
    settings, engine = think_engine
    plan.tokens = [*ids(engine, "Fine."), EOS]
    settings.disable_grammar_support = True
    try:
        free = chat(app_client, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}).json()
        refused = app_client.post("/v1/chat/completions", json={
            "model": "tgi", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
            "tool_choice": "required"})
    finally:
        settings.disable_grammar_support = False
    assert free["choices"][0]["message"] == {"role": "assistant", "content": "Fine."}
    assert refused.status_code == 422 and refused.json()["error_type"] == "tool_error"
