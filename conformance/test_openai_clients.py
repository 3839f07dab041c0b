"""The OpenAI routes against a live server, through the official clients used unchanged: the `openai`
SDK (sync and async, streaming and not) and `huggingface_hub.InferenceClient.chat_completion`.

Most tests use the session's `live_server` (tiny random-weight Llama with SmolLM2's tokenizer and
chat template): they check shapes, counts, constraints and determinism, not the words. The FIM test
runs a second server on the tiny Llama whose tokenizer has StarCoder FIM tokens; the slow test
asks the real default model (SmolLM2-135M-Instruct) a question.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError
from transformers import AutoTokenizer

from conformance.live import free_port, serve
from opentgi.config import Settings
from tests.helpers import tiny_models

torch.set_num_threads(1)

MESSAGES = [{"role": "user", "content": "What is Deep Learning?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"]}}}
# TGI's own field: the live server's 192-token input limit leaves no room for its long default.
SHORT_TOOL_PROMPT = {"tool_prompt": "Answer with one of these tools:\n"}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(live_server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(live_settings):
    return AutoTokenizer.from_pretrained(live_settings.model_id)


def _greedy(client, **kwargs):
    return client.chat.completions.create(model="tgi", messages=MESSAGES, temperature=0, **kwargs)


# --- chat --------------------------------------------------------------------------------------------


def test_chat_completion_shape_and_usage(client, live_settings, tokenizer):
    out = _greedy(client, max_tokens=6)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model == live_settings.model_id
    assert out.system_fingerprint
    (choice,) = out.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= out.usage.completion_tokens <= 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_n_choices_are_sampled_and_seeded(client):
    kwargs = {"model": "tgi", "messages": MESSAGES, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 7}
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # really n samples (TGI 2.1 ignores n)
    assert texts == [c.message.content for c in again.choices]  # same seed, same choices
    assert 3 <= first.usage.completion_tokens <= 15


def test_chat_logprobs(client):
    out = _greedy(client, max_tokens=4, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) >= 2
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)


def test_chat_logit_bias_is_applied(client, tokenizer):
    plain = _greedy(client, max_tokens=1, logprobs=True)
    forced_id = tokenizer.convert_tokens_to_ids("Paris")
    assert forced_id != tokenizer.unk_token_id
    biased = _greedy(client, max_tokens=1, logprobs=True, logit_bias={str(forced_id): 100})
    assert plain.choices[0].logprobs.content[0].token != "Paris"
    assert biased.choices[0].message.content == "Paris"


def test_chat_stream_with_usage_matches_non_streaming(client):
    whole = _greedy(client, max_tokens=8)
    chunks = list(_greedy(client, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def _stop_spanning_tokens(client) -> tuple[str, str]:
    """Greedy text and a stop string that starts inside one token and ends inside the next."""
    out = _greedy(client, max_tokens=12, logprobs=True)
    tokens = [t.token for t in out.choices[0].logprobs.content]
    text = out.choices[0].message.content
    offset = 0
    for a, b in itertools.pairwise(tokens):
        offset += len(a)
        if len(a) >= 2 and len(b) >= 2 and text.count(text[offset - 1:offset + 1]) == 1:
            return text, text[offset - 1:offset + 1]
    pytest.fail(f"no two adjacent multi-character tokens in {tokens}")


def test_stop_string_spanning_tokens_is_never_emitted(client):
    text, stop = _stop_spanning_tokens(client)
    expected = text[:text.index(stop)]
    out = _greedy(client, max_tokens=12, stop=stop)
    assert out.choices[0].message.content == expected and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in _greedy(client, max_tokens=12, stop=[stop],
                                                                           stream=True))
    assert streamed == expected


def test_held_back_text_is_released_when_the_stream_ends_otherwise(client):
    """The output's tail (end of the next-to-last token + the last token) is a prefix of the stop
    string: held back while streaming, then released when max_tokens ends the stream."""
    whole = _greedy(client, max_tokens=8, logprobs=True).choices[0]
    assert whole.finish_reason == "length"
    text, tokens = whole.message.content, [t.token for t in whole.logprobs.content]
    held = min(2, len(tokens[-2])) + len(tokens[-1])
    stop = text[-held:] + "\u2603\u2603"
    chunks = list(_greedy(client, max_tokens=8, stop=[stop], stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(pieces[:-1]) == text[:-held]  # nothing of the possible stop string went out early


def test_tool_choice_required_gives_openai_tool_call(client):
    out = client.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, seed=1,
                                         extra_body=SHORT_TOOL_PROMPT)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert isinstance(call.function.arguments, str)  # a JSON string, as OpenAI (TGI 2.1 sends an object)
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=60, stream=True,
        extra_body=SHORT_TOOL_PROMPT)
    chunks = list(stream)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_time" and calls[0].id.startswith("call_") and calls[0].index == 0
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    jsonschema.validate(json.loads(arguments), TIME["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_call_history_round_trip(client):
    """An assistant tool call and the tool's answer (content null, tool_call_id) are accepted."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"},
    ]
    out = client.chat.completions.create(model="tgi", messages=messages, tools=[WEATHER], tool_choice="none",
                                         max_tokens=3)
    assert isinstance(out.choices[0].message.content, str)


def test_response_format_json_schema_validates(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=60, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_tool_choice_auto_answers_a_call_or_text(client):
    for seed in range(3):
        out = client.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Hi"}],
                                             tools=[TIME], max_tokens=60, seed=seed, extra_body=SHORT_TOOL_PROMPT)
        choice = out.choices[0]
        if choice.message.tool_calls:
            assert choice.message.content is None and choice.message.tool_calls[0].function.name == "get_time"
            if choice.finish_reason == "tool_calls":
                jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                                    TIME["function"]["parameters"])
            else:
                assert choice.finish_reason == "length"
        else:  # the text answer, decoded from its JSON string (a random model rarely closes it)
            assert choice.finish_reason in ("stop", "length")
            assert not choice.message.content.lstrip().startswith("{")


class Verdict(pydantic.BaseModel):
    ok: bool
    grade: Literal["a", "b", "c"]


def test_sdk_structured_output_parse(client):
    """The SDK's own structured-output helper: a pydantic model becomes a strict json_schema."""
    out = client.chat.completions.parse(model="tgi", messages=MESSAGES, response_format=Verdict, max_tokens=40)
    assert isinstance(out.choices[0].message.parsed, Verdict)


def test_sdk_pydantic_function_tool_parse(client):
    out = client.chat.completions.parse(model="tgi", messages=[{"role": "user", "content": "Grade it"}],
                                        tools=[openai.pydantic_function_tool(Verdict)], tool_choice="required",
                                        max_tokens=60, extra_body=SHORT_TOOL_PROMPT)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "Verdict" and isinstance(call.function.parsed_arguments, Verdict)


@pytest.mark.parametrize("response_format,check", [
    ({"type": "regex", "value": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
    ({"type": "json", "value": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     lambda text: all(isinstance(v, bool) for v in json.loads(text))),
])
def test_response_format_tgi_and_openai_forms(client, response_format, check):
    out = client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=60, seed=5,
                                         response_format=response_format)
    assert out.choices[0].finish_reason == "stop"
    assert check(out.choices[0].message.content)


def test_max_completion_tokens(client):
    out = _greedy(client, max_completion_tokens=2)
    assert out.usage.completion_tokens <= 2


async def test_async_client_chat_and_stream(aclient):
    out = await aclient.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=4, temperature=0)
    stream = await aclient.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=4, temperature=0,
                                                   stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == out.choices[0].message.content


# --- errors as the SDK's typed errors ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match,error_type", [
    ({"max_tokens": 5000}, "max_new_tokens", "validation"),
    ({"n": 100}, "`n`", "validation"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "Tool error: Grammar and tools are mutually exclusive", "tool_error"),
    ({"tools": [WEATHER], "tool_choice": "nope"}, "Tool error: Tool with name nope not found", "tool_error"),
    ({"logit_bias": {"99999999": 5}}, "vocabulary", "validation"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_requests_raise_unprocessable(client, kwargs, match, error_type, stream):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", messages=MESSAGES, stream=stream, **kwargs)
    # TGI's error shape: {"error": "<message>", "error_type": ...}; the SDK keeps the message as `body`.
    assert info.value.status_code == 422 and match in info.value.body
    assert info.value.response.json()["error_type"] == error_type


def test_image_content_on_text_model_is_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model="tgi", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert "text only" in info.value.body


# --- completions -----------------------------------------------------------------------------------


def test_completions_prompt_list_n_and_echo(client, tokenizer):
    prompts = ["def fib(n):", "The capital of France is"]
    out = client.completions.create(model="tgi", prompt=prompts, max_tokens=3, n=2, echo=True, logprobs=1,
                                    temperature=0)
    assert out.object == "text_completion"
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for choice in out.choices:
        prompt = prompts[choice.index // 2]
        assert choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs[0] is None  # echoed prompt: the first token has none
        assert choice.logprobs.text_offset[0] == 0
    assert out.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert out.usage.completion_tokens == 4 * 3


def test_completions_stream_with_usage(client):
    whole = client.completions.create(model="tgi", prompt="Hello", max_tokens=5, temperature=0)
    chunks = list(client.completions.create(model="tgi", prompt="Hello", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_completions_stream_echo_carries_the_prompt_logprobs(client):
    kwargs = {"model": "tgi", "prompt": ["Hello there", "def f(x):"], "max_tokens": 3, "temperature": 0,
              "echo": True, "logprobs": 1}
    whole = client.completions.create(**kwargs)
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    for choice in whole.choices:
        mine = [c for c in chunks if c.index == choice.index]
        assert mine[0].text == kwargs["prompt"][choice.index]  # the echo comes first, with its logprobs
        assert "".join(c.text for c in mine) == choice.text
        streamed = [lp for c in mine for lp in c.logprobs.token_logprobs]
        assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-4)
        assert [o for c in mine for o in c.logprobs.text_offset] == choice.logprobs.text_offset


def test_completions_stop_is_left_out(client):
    whole = client.completions.create(model="tgi", prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    stop = whole[3:6]
    out = client.completions.create(model="tgi", prompt="Hello", max_tokens=8, temperature=0, stop=stop)
    assert out.choices[0].text == whole[:whole.index(stop)] and out.choices[0].finish_reason == "stop"


def test_suffix_without_fim_tokens_is_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model="tgi", prompt="def f(", suffix="):", max_tokens=2)
    assert "fill-in-the-middle" in info.value.body


# --- huggingface_hub ---------------------------------------------------------------------------------


def test_huggingface_hub_chat_completion(live_server):
    hf = InferenceClient(base_url=live_server)
    out = hf.chat_completion(messages=MESSAGES, max_tokens=5, temperature=0)
    text = "".join(c.choices[0].delta.content or "" for c in hf.chat_completion(
        messages=MESSAGES, max_tokens=5, temperature=0, stream=True) if c.choices)
    assert text == out.choices[0].message.content
    tools = hf.chat_completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                               tool_choice="required", max_tokens=60)
    call = tools.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with pytest.raises(HfHubHTTPError) as info:
        hf.chat_completion(messages=MESSAGES, max_tokens=5000)
    assert info.value.response.status_code == 422
    assert info.value.response.json()["error_type"] == "validation"


def test_sse_framing_and_done(live_server):
    body = {"messages": MESSAGES, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{live_server}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data:{") for line in lines[:-1])
    assert lines[-1] == "data: [DONE]"


def _metric(base: str, line_start: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start + " ")]
    return values[0] if values else 0.0


def test_requests_are_counted_in_tgi_metrics(client, live_server):
    before = {name: _metric(live_server, name) for name in (
        "tgi_request_count", "tgi_request_success", 'tgi_request_failure{err="validation"}')}
    _greedy(client, max_tokens=2)
    list(client.completions.create(model="tgi", prompt="a", max_tokens=2, stream=True))
    with pytest.raises(openai.UnprocessableEntityError):
        _greedy(client, n=100)
    after = {name: _metric(live_server, name) for name in before}
    assert after["tgi_request_count"] - before["tgi_request_count"] == 3
    assert after["tgi_request_success"] - before["tgi_request_success"] == 2
    assert after['tgi_request_failure{err="validation"}'] - before['tgi_request_failure{err="validation"}'] == 1


# --- servers of our own: FIM and the default model ----------------------------------------------------


def test_completions_suffix_fill_in_the_middle():
    path = tiny_models.tiny_fim_llama_path()
    settings = Settings(model_id=str(path), device="cpu", hostname="127.0.0.1", port=free_port(),
                        max_input_tokens=192, max_total_tokens=256, max_batch_total_tokens=1024)
    tok = AutoTokenizer.from_pretrained(path)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    with serve(settings) as base:
        fim = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = fim.completions.create(model="tgi", prompt=prefix, suffix=suffix, max_tokens=4, temperature=0)
        plain = fim.completions.create(model="tgi", prompt=prefix, max_tokens=4, temperature=0)
    fim_ids = tok.encode(prefix, add_special_tokens=False) + tok.encode(suffix, add_special_tokens=False)
    assert out.usage.prompt_tokens == len(fim_ids) + 3  # <fim_prefix> .. <fim_suffix> .. <fim_middle>
    assert plain.usage.prompt_tokens == len(tok(prefix)["input_ids"])
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_server):
    base = default_server
    chat = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    out = chat.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=30, temperature=0)
    assert "Paris" in out.choices[0].message.content
