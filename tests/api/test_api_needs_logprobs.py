"""`GenerationRequest.needs_logprobs` as each dialect's handler sets it, through the real app and a
tiny engine: False exactly where the answer (streamed or not) shows nothing derived from the
generated tokens' logprobs, and such an answer serializes with no logprob in it; True wherever one
is shown (the answer then carries numbers) or ranks by them (TGI's best_of)."""

from __future__ import annotations

import json

import pytest

CHAT = [{"role": "user", "content": "Hello"}]
SAMPLED = {"do_sample": True, "temperature": 0.9}
HIDDEN = "hidden"  # needs_logprobs True, though the answer shows no logprob

# (path, body, needs_logprobs: False, True or HIDDEN)
CASES = [
    # TGI: /generate shows logprobs only in `details`; every /generate_stream event has token.logprob
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, False),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, **SAMPLED, "seed": 3}}, False),
    ("/", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, False),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True}}, True),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "decoder_input_details": True}}, True),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "top_n_tokens": 2, "details": True}}, True),
    # the sampler computes them for top-n anyway (kept True, though /generate shows them in details only)
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "top_n_tokens": 2}}, HIDDEN),
    # best_of returns the sequence of the highest mean logprob
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, **SAMPLED, "best_of": 2}}, HIDDEN),
    ("/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, True),
    ("/", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 3}}, True),
    # OpenAI completions: `logprobs` (0 too) shows token_logprobs
    ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 3}, False),
    ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 3, "stream": True}, False),
    ("/v1/completions", {"model": "m", "prompt": ["Hello", "Hi"], "max_tokens": 3, "n": 2, "seed": 1,
                         "temperature": 0.9, "echo": True}, False),
    ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 3, "logprobs": 0}, True),
    ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 3, "logprobs": 2, "stream": True}, True),
    # OpenAI chat: `logprobs: true`
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 3}, False),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 3, "n": 2, "temperature": 0.9,
                              "stream": True, "logprobs": False}, False),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 3, "logprobs": True}, True),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 3, "logprobs": True,
                              "top_logprobs": 2, "stream": True}, True),
    # LightLLM: /generate shows them with return_details; every stream event has token.logprob
    ("/lightllm/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, False),
    ("/lightllm/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, **SAMPLED, "best_of": 2,
                                                              "n": 2}}, False),
    ("/lightllm/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "return_details": True}}, True),
    ("/lightllm/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, True),
    # SenseNova: no answer shows a logprob
    ("/sensenova/v1/llm/completions", {"model": "m", "prompt": "Hello", "max_new_tokens": 3}, False),
    ("/sensenova/v1/llm/completions", {"model": "m", "prompt": "Hello", "max_new_tokens": 3, "n": 2,
                                       "stream": True}, False),
]


def payloads(response) -> list:
    """The JSON answer, or every JSON event of a stream (whatever the dialect's SSE framing)."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return [response.json()]
    out = []
    for line in response.text.splitlines():
        data = line[len("data:"):].strip() if line.startswith("data:") else ""
        if data.startswith("{"):
            out.append(json.loads(data))
    assert out, response.text
    return out


def logprob_values(node) -> list:
    """Every value under a key that names a logprob ("logprob", "token_logprobs", "logprobs", ...)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if "logprob" in key:
                found.append(value)
            found.extend(logprob_values(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(logprob_values(value))
    return found


def numbers(node) -> list[float]:
    if isinstance(node, bool):
        return []
    if isinstance(node, (int, float)):
        return [node]
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return [n for v in values for n in numbers(v)]


@pytest.mark.parametrize(("path", "body", "needs"), CASES, ids=[f"{p} {json.dumps(b)}" for p, b, _ in CASES])
def test_needs_logprobs_per_response_shape(client, engine, monkeypatch, path, body, needs):
    _, eng = engine
    seen = []
    submit = eng.submit

    async def recording(request):
        seen.append(request.needs_logprobs)
        return await submit(request)

    monkeypatch.setattr(eng, "submit", recording)
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    answers = payloads(response)
    assert seen and all(flag is bool(needs) for flag in seen), seen
    shown = logprob_values(answers)
    if needs is True:
        assert numbers(shown), answers  # the engine computed them and the answer shows them
    elif needs is False:
        # nothing that names a logprob carries a value (OpenAI's `"logprobs": null` is the shape)
        assert all(value is None for value in shown), answers
