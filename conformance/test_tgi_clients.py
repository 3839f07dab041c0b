"""Real TGI clients against the live server: HF's `text-generation` (Client, AsyncClient) and
`huggingface_hub.InferenceClient.text_generation`, plus behaviour tests from TGI's own suite.

The server runs the tiny random-weight Llama (conformance/conftest.py: max_input_tokens 192,
max_total_tokens 256, TGI's defaults for best_of 2, stop sequences 4, top_n_tokens 5).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hub_errors
from text_generation import AsyncClient, Client
from text_generation import errors as tg_errors
from text_generation.types import FinishReason, Grammar, GrammarType

from opentgi.engine.sampling.watermark import detect_watermark

torch.set_num_threads(1)

PROMPT = "The capital of France is"
TIMEOUT = 120
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 1, "maximum": 5},
                   "ok": {"type": "boolean"}},
    "required": ["color", "count", "ok"],
}
SKU = r"[A-Z]{3}-\d{4}"


@pytest.fixture(scope="module")
def client(live_server) -> Client:
    return Client(live_server, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def hub(live_server) -> InferenceClient:
    return InferenceClient(model=live_server, timeout=TIMEOUT)


@pytest.fixture
def async_client(live_server) -> AsyncClient:
    return AsyncClient(live_server, timeout=TIMEOUT)


# --- text-generation Client ---------------------------------------------------------------------------


def test_generate_details_and_finish_reason_contract(client):
    r = client.generate(PROMPT, max_new_tokens=10)
    d = r.details
    assert len(d.tokens) == d.generated_tokens
    assert (d.finish_reason == FinishReason.Length) == (d.generated_tokens == 10)
    assert d.generated_tokens <= 10
    assert r.generated_text == "".join(t.text for t in d.tokens if not t.special)
    assert d.seed is None  # greedy


def test_stream_tokens_concatenate_to_generated_text(client):
    events = list(client.generate_stream(PROMPT, max_new_tokens=12))
    assert events and all(e.generated_text is None for e in events[:-1])
    last = events[-1]
    assert last.details is not None and last.details.generated_tokens == len(events)
    assert "".join(e.token.text for e in events if not e.token.special) == last.generated_text
    assert last.generated_text == client.generate(PROMPT, max_new_tokens=12).generated_text


def test_decoder_input_details_and_truncate(client):
    full = client.generate(PROMPT, max_new_tokens=2, decoder_input_details=True)
    prefill = full.details.prefill
    assert prefill[0].logprob is None and all(t.logprob is not None for t in prefill[1:])
    truncated = client.generate(PROMPT, max_new_tokens=2, decoder_input_details=True, truncate=5)
    assert len(truncated.details.prefill) == 5
    assert [t.id for t in truncated.details.prefill] == [t.id for t in prefill[-5:]]


def test_top_n_tokens(client):
    r = client.generate(PROMPT, max_new_tokens=4, top_n_tokens=3)
    assert len(r.details.top_tokens) == r.details.generated_tokens
    for chosen, alternatives in zip(r.details.tokens, r.details.top_tokens):
        assert len(alternatives) >= 3
        assert chosen.id == alternatives[0].id  # greedy picks the most likely token
        logprobs = [t.logprob for t in alternatives]
        assert logprobs == sorted(logprobs, reverse=True)


def test_best_of_returns_the_other_sequences(client):
    r = client.generate(PROMPT, max_new_tokens=5, do_sample=True, best_of=2)
    assert len(r.details.best_of_sequences) == 1
    other = r.details.best_of_sequences[0]
    assert other.generated_tokens == len(other.tokens)
    assert r.details.seed is not None and other.seed is not None


def test_seed_makes_sampling_reproducible(client):
    a = client.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=1234)
    b = client.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=1234)
    assert a.details.seed == 1234
    assert [t.id for t in a.details.tokens] == [t.id for t in b.details.tokens]


def test_stop_sequence_ends_generation(client):
    free = client.generate(PROMPT, max_new_tokens=10)
    index, stop = next((i, t.text) for i, t in enumerate(free.details.tokens)
                       if i >= 1 and t.text.strip() and not t.special)
    r = client.generate(PROMPT, max_new_tokens=10, stop_sequences=[stop])
    assert r.details.finish_reason == FinishReason.StopSequence
    assert r.generated_text.endswith(stop)
    assert r.details.generated_tokens <= index + 1


def test_json_grammar(client):
    r = client.generate(PROMPT, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=SCHEMA))
    jsonschema.validate(json.loads(r.generated_text), SCHEMA)
    assert r.details.finish_reason == FinishReason.EndOfSequenceToken


def test_regex_grammar_sampled(client):
    for seed in range(3):
        r = client.generate(PROMPT, max_new_tokens=20, do_sample=True, seed=seed,
                            grammar=Grammar(type=GrammarType.Regex, value=SKU))
        assert re.fullmatch(SKU, r.generated_text), r.generated_text


def test_watermarked_generation_is_detected(client):
    prompt_ids = [t.id for t in client.generate(PROMPT, max_new_tokens=1, decoder_input_details=True)
                  .details.prefill]
    vocab = 49152  # the tiny Llama's vocabulary (SmolLM2's tokenizer)
    for watermark in (True, False):
        r = client.generate(PROMPT, max_new_tokens=100, do_sample=True, seed=7, watermark=watermark)
        ids = [t.id for t in r.details.tokens]
        d = detect_watermark(ids, vocab, 0.5, last_prompt_token=prompt_ids[-1])
        assert d.num_scored_tokens == len(ids) >= 50
        assert d.is_watermarked == watermark, d


# --- validation errors surface as the client's typed exceptions with TGI's messages ---------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 1000},
     r"`inputs` tokens \+ `max_new_tokens` must be <= 256\. Given: \d+ `inputs` tokens and 1000 `max_new_tokens`"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, r"`stop` supports up to 4 stop sequences\. Given: 5"),
    ({"top_n_tokens": 6}, r"`top_n_tokens` must be >= 0 and <= 5\. Given: 6"),
    ({"best_of": 3, "do_sample": True}, r"`best_of` must be > 0 and <= 2\. Given: 3"),
    ({"truncate": 500}, r"`truncate` must be strictly positive and less than 192\. Given: 500"),
    ({"frequency_penalty": 3.0}, r"`frequency_penalty` must be >= -2\.0 and <= 2\.0"),
    ({"grammar": Grammar(type=GrammarType.Regex, value="(unclosed")}, r"grammar is not valid: .+"),
])
def test_validation_errors_are_typed(client, kwargs, message):
    with pytest.raises(tg_errors.ValidationError) as info:
        client.generate(PROMPT, **kwargs)
    assert re.fullmatch("Input validation error: " + message, str(info.value)), str(info.value)


def test_input_too_long_is_a_validation_error(client):
    with pytest.raises(tg_errors.ValidationError) as info:
        client.generate("hello " * 300, max_new_tokens=1)
    assert re.fullmatch(r"Input validation error: (`inputs` tokens \+ `max_new_tokens` must be <= 256\. Given: \d+ `inputs` tokens "
                        r"and 1 `max_new_tokens`|`inputs` must have less than 192 tokens\. Given: \d+)",
                        str(info.value)), str(info.value)


def test_stream_validation_error_is_typed(client):
    with pytest.raises(tg_errors.ValidationError) as info:
        list(client.generate_stream(PROMPT, max_new_tokens=1000))
    assert "`max_new_tokens`" in str(info.value)


# --- text-generation AsyncClient ----------------------------------------------------------------------


async def test_four_concurrent_identical_greedy_requests_agree(async_client):
    responses = await asyncio.gather(*[async_client.generate(PROMPT, max_new_tokens=10) for _ in range(4)])
    texts = {r.generated_text for r in responses}
    ids = {tuple(t.id for t in r.details.tokens) for r in responses}
    assert len(texts) == 1 and len(ids) == 1


async def test_async_stream_and_errors(async_client):
    events = [e async for e in async_client.generate_stream(PROMPT, max_new_tokens=6)]
    assert events[-1].details.generated_tokens == len(events)
    with pytest.raises(tg_errors.ValidationError):
        await async_client.generate(PROMPT, top_n_tokens=6)


# --- huggingface_hub.InferenceClient ------------------------------------------------------------------


def test_hub_text_generation(hub, client):
    generated = client.generate(PROMPT, max_new_tokens=8).generated_text
    # The hub client posts to `POST /`, where TGI returns the full text for a text-generation model
    # unless return_full_text is given.
    assert hub.text_generation(PROMPT, max_new_tokens=8) == PROMPT + generated
    text = hub.text_generation(PROMPT, max_new_tokens=8, return_full_text=False)
    assert text == generated
    out = hub.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True,
                              top_n_tokens=2, return_full_text=False)
    assert out.generated_text == text
    assert out.details.generated_tokens == len(out.details.tokens)
    assert out.details.prefill and len(out.details.top_tokens) == out.details.generated_tokens


def test_hub_stream(hub, client):
    chunks = list(hub.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert "".join(chunks) == client.generate(PROMPT, max_new_tokens=8).generated_text
    events = list(hub.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert events[-1].details.generated_tokens == len(events)


def test_hub_best_of_and_empty_inputs(hub):
    out = hub.text_generation(PROMPT, max_new_tokens=4, best_of=2, do_sample=True, details=True)
    assert out.details.best_of_sequences is not None and len(out.details.best_of_sequences) == 1
    assert out.details.best_of_sequences[0].generated_tokens == len(out.details.best_of_sequences[0].tokens)
    with pytest.raises(hub_errors.ValidationError, match=r"^Input validation error: `inputs` cannot be empty$"):
        hub.text_generation("", max_new_tokens=2)


def test_hub_grammar_seed_and_stop(hub):
    text = hub.text_generation(PROMPT, max_new_tokens=60, grammar={"type": "json", "value": SCHEMA},
                               return_full_text=False)
    jsonschema.validate(json.loads(text), SCHEMA)
    a = hub.text_generation(PROMPT, max_new_tokens=6, do_sample=True, seed=3, details=True)
    b = hub.text_generation(PROMPT, max_new_tokens=6, do_sample=True, seed=3, details=True)
    assert a.details.seed == 3 and a.generated_text == b.generated_text
    regex = hub.text_generation(PROMPT, max_new_tokens=20, grammar={"type": "regex", "value": SKU},
                                return_full_text=False)
    assert re.fullmatch(SKU, regex)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 1000}, r"`inputs` tokens \+ `max_new_tokens` must be <= 256\..*"),
    ({"top_n_tokens": 6}, r"`top_n_tokens` must be >= 0 and <= 5\. Given: 6"),
    ({"temperature": 0.0}, r"`temperature` must be strictly positive"),
    ({"top_p": 1.0}, r"`top_p` must be > 0\.0 and < 1\.0"),
    ({"grammar": {"type": "json", "value": {"type": 5}}}, r"grammar is not valid: .+"),
    # the rest of TGI's checks, which the hub client (unlike text-generation's) sends unchecked
    ({"best_of": 2}, r"you must use sampling when `best_of` is > 1"),
    ({"repetition_penalty": 0.0}, r"`repetition_penalty` must be strictly positive"),
    ({"typical_p": 1.0}, r"`typical_p` must be > 0\.0 and < 1\.0"),
    ({"top_k": 0}, r"`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, r"`max_new_tokens` must be strictly positive"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, r"`seed` must not be set when `best_of` > 1"),
    ({"top_k": 0, "temperature": 0.0}, r"`temperature` must be strictly positive"),  # TGI's order
])
def test_hub_validation_errors_are_typed(hub, kwargs, message):
    with pytest.raises(hub_errors.ValidationError) as info:
        hub.text_generation(PROMPT, **kwargs)
    assert re.fullmatch("Input validation error: " + message, str(info.value)), str(info.value)


# --- /metrics as TGI's Prometheus scrapers and dashboards read it ---------------------------------------


def _scrape(base_url: str) -> dict[str, float]:
    import httpx

    response = httpx.get(f"{base_url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert "# TYPE tgi_request_count counter" in response.text
    return values


def test_metrics_count_requests_like_tgi(live_server, client):
    before = _scrape(live_server)
    r = client.generate(PROMPT, max_new_tokens=5)
    with pytest.raises(tg_errors.ValidationError):
        client.generate(PROMPT, top_n_tokens=6)
    after = _scrape(live_server)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("tgi_request_count") == 2
    assert delta("tgi_request_success") == 1
    assert delta('tgi_request_failure{err="validation"}') == 1
    assert delta("tgi_request_generated_tokens_sum") == r.details.generated_tokens
    assert delta("tgi_request_duration_count") == 1
    assert delta("tgi_request_max_new_tokens_sum") >= 5
    # the engine's side, through the observer: one prefill and the decodes of this generation at least
    assert delta('tgi_batch_inference_count{method="prefill"}') >= 1
    assert delta('tgi_batch_inference_success{method="decode"}') >= r.details.generated_tokens - 1
    assert delta("opentgi_generation_tokens_total") >= r.details.generated_tokens
