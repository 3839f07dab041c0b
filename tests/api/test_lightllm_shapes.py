"""LightLLM dialect: request mapping and response shapes, byte for byte, without an engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from opentgi.api.errors import RequestSchemaError
from opentgi.api.lightllm import handlers, shapes
from opentgi.api.lightllm import params as request_params
from opentgi.api.lightllm.errors import lightllm_error
from opentgi.engine.errors import (
    GenerationError,
    InputTooLongError,
    NotSupportedError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)
from opentgi.engine.events import GenerationResult, SequenceResult, Timings, TokenEvent
from opentgi.engine.request import FinishReason
from opentgi.schemas import lightllm as schema


def event(index, token_id, text, logprob, n, reason=None, special=False):
    return TokenEvent(
        index=index, token_id=token_id, token_text=text, logprob=logprob, special=special,
        text_delta=text, generated_tokens=n, finish_reason=reason,
    )


def sequence(index, tokens, reason):
    return SequenceResult(
        index=index, token_ids=[t.token_id for t in tokens], text="".join(t.text_delta for t in tokens),
        finish_reason=reason, seed=None, tokens=tokens,
    )


def result(*sequences, prompt=(1, 2, 3, 4), score=None):
    return GenerationResult(
        request_id="req-1", prompt_token_ids=list(prompt), sequences=list(sequences),
        timings=Timings(queued_at=0.0), score=score,
    )


SEQ0 = [event(0, 3555, " What", -1.8383026123046875, 1), event(0, 374, " is", -0.5, 2, FinishReason.LENGTH)]
SEQ1 = [event(1, 279, " the", -1.5, 1, FinishReason.EOS_TOKEN)]


def test_generate_response_one_sequence_bytes():
    body = shapes.dumps(shapes.generate_response(result(sequence(0, SEQ0, FinishReason.LENGTH))))
    assert body == (
        '{"generated_text": [" What is"], "count_output_tokens": 2, "finish_reason": "length", '
        '"prompt_tokens": 4}'
    )


def test_generate_response_n_sequences_become_lists():
    res = result(sequence(1, SEQ1, FinishReason.EOS_TOKEN), sequence(0, SEQ0, FinishReason.LENGTH))
    assert shapes.generate_response(res) == {
        "generated_text": [" What is", " the"],
        "count_output_tokens": [2, 1],
        "finish_reason": ["length", "stop"],
        "prompt_tokens": 4,
    }


def test_generate_response_with_details():
    res = shapes.generate_response(result(sequence(0, SEQ0, FinishReason.LENGTH)), return_details=True)
    assert res["tokens"] == [
        {"id": 3555, "text": " What", "logprob": -1.8383026123046875, "special": False,
         "count_output_tokens": 1, "prompt_tokens": 4},
        {"id": 374, "text": " is", "logprob": -0.5, "special": False, "count_output_tokens": 2,
         "prompt_tokens": 4},
    ]
    two = shapes.generate_response(
        result(sequence(0, SEQ0, FinishReason.LENGTH), sequence(1, SEQ1, FinishReason.EOS_TOKEN)),
        return_details=True,
    )
    assert [len(t) for t in two["tokens"]] == [2, 1]


def test_stream_event_bytes_match_lightllm():
    first = shapes.stream_event(SEQ0[0], 4)
    assert first == (
        '{"token": {"id": 3555, "text": " What", "logprob": -1.8383026123046875, "special": false, '
        '"count_output_tokens": 1, "prompt_tokens": 4}, "generated_text": null, "finished": false, '
        '"finish_reason": null, "details": null}'
    )
    last = json.loads(shapes.stream_event(SEQ0[1], 4))
    assert last["finished"] is True and last["finish_reason"] == "length"
    assert json.loads(shapes.stream_event(SEQ1[0], 4))["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "reason, expected",
    [
        (FinishReason.LENGTH, "length"),
        (FinishReason.CONTEXT, "length"),
        (FinishReason.EOS_TOKEN, "stop"),
        (FinishReason.STOP_SEQUENCE, "stop"),
        (FinishReason.GRAMMAR, "stop"),
        (FinishReason.SENSITIVE, "stop"),
    ],
)
def test_finish_reasons(reason, expected):
    assert shapes.lightllm_finish_reason(reason) == expected


def test_score_response_bytes():
    body = shapes.dumps(shapes.score_response(result(prompt=range(39), score=0.4892578125)))
    assert body == '{"score": 0.4892578125, "prompt_tokens": 39, "finish_reason": "stop"}'
    with pytest.raises(GenerationError):
        shapes.score_response(result(prompt=range(3), score=None))


def stats(held, peak, cached_blocks=0):
    return SimpleNamespace(tokens_held_running=held, peak_tokens_running=peak, cached_blocks=cached_blocks)


def test_token_load_arithmetic():
    # 3 running requests hold 120 + 64 + 16 = 200 tokens of a 1000-token pool; they may still generate
    # 100 + 200 + 100 more: peak 600. Evictable cached prefixes (30 blocks) do not count.
    load = shapes.compute_token_load(stats(200, 600, cached_blocks=30), 1000)
    assert load == {"current_load": 0.2, "logical_max_load": 0.6, "dynamic_max_load": 0.6}
    assert shapes.compute_token_load(stats(0, 0), 4096) == {
        "current_load": 0.0, "logical_max_load": 0.0, "dynamic_max_load": 0.0,
    }


def params(**kw) -> schema.GenerateParameters:
    return schema.GenerateParameters.model_validate(kw)


def test_sampling_defaults_are_greedy():
    sampling = request_params.sampling_params(params(temperature=0.5, top_k=5))
    assert sampling.do_sample is False and sampling.temperature == 1.0
    sampling = request_params.sampling_params(params(do_sample=True, temperature=1e-6))
    assert sampling.do_sample is False


def test_sampling_mapping():
    sampling = request_params.sampling_params(
        params(do_sample=True, temperature=0.7, top_p=0.9, top_k=-1, presence_penalty=0.5,
               frequency_penalty=1.0, repetition_penalty=1.2, seed=7)
    )
    assert (sampling.do_sample, sampling.temperature, sampling.top_p, sampling.top_k) == (True, 0.7, 0.9, 0)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, 1.0, 1.2)
    assert sampling.seed == 7
    assert request_params.sampling_params(params(do_sample=True, top_k=40)).top_k == 40


def test_stopping_mapping():
    stopping = request_params.stopping_params(params())
    assert (stopping.max_new_tokens, stopping.min_new_tokens, stopping.stop_sequences) == (16, 1, [])
    stopping = request_params.stopping_params(
        params(max_new_tokens=9, min_new_tokens=3, stop_sequences="\n\n", ignore_eos=True)
    )
    assert (stopping.max_new_tokens, stopping.min_new_tokens, stopping.ignore_eos) == (9, 3, True)
    assert stopping.stop_sequences == ["\n\n"] and stopping.include_stop_str_in_output
    assert request_params.stopping_params(params(stop_sequences=["a", "b"])).stop_sequences == ["a", "b"]
    with pytest.raises(ValidationError, match="min_new_tokens must <= max_new_tokens"):
        request_params.stopping_params(params(max_new_tokens=2, min_new_tokens=3))


def test_stop_sequences_as_token_ids(smollm2_tokenizer):
    """LightLLM accepts str, list[str] and list[list[int]]: one id stops on that token, a longer
    sequence on its decoded text; empty entries are ignored."""
    tok = smollm2_tokenizer
    hello = tok.encode(" Hello world", add_special_tokens=False)
    assert len(hello) > 1
    parsed = schema.GenerateParameters.model_validate({"stop_sequences": [[hello[0]], hello, []]})
    stopping = request_params.stopping_params(parsed, tok)
    assert stopping.stop_token_ids == [hello[0]]
    assert stopping.stop_sequences == [" Hello world"]
    assert request_params.stop_conditions("\n", tok) == (["\n"], [])
    assert request_params.stop_conditions(["a", ""], None) == (["a"], [])  # strings need no tokenizer
    for bad in (len(tok), -1):
        with pytest.raises(ValidationError, match=f"token id {bad} is not in the vocabulary"):
            request_params.stop_conditions([[bad]], tok)


def test_lengths_checked_in_lightllm_words():
    request_params.check_lengths(10, 90, 50, 100)  # fits exactly
    with pytest.raises(InputTooLongError, match="the input prompt token len 51 is too long > 50"):
        request_params.check_lengths(51, 1, 50, 100)
    with pytest.raises(InputTooLongError, match=r"too long > max_req_total_len:100"):
        request_params.check_lengths(10, 91, 50, 100)  # never generated until the context cuts it short


def test_n_and_best_of():
    assert request_params.num_sequences(params()) == 1
    assert request_params.num_sequences(params(best_of=3)) == 3
    assert request_params.num_sequences(params(n=4)) == 4
    assert request_params.num_sequences(params(n=2, best_of=2)) == 2
    with pytest.raises(ValidationError, match="n == best_of"):
        request_params.num_sequences(params(n=2, best_of=3))


def test_multimodal_input_is_refused_on_a_text_model():
    request_params.check_text_only(None, "m")
    request_params.check_text_only(schema.MultimodalParams(), "m")
    request_params.check_text_only(schema.MultimodalParams(images=[]), "m")
    with pytest.raises(NotSupportedError, match="text model"):
        request_params.check_text_only(schema.MultimodalParams(images=[{"type": "base64", "data": "AAAA"}]), "m")


@pytest.mark.parametrize(
    "exc, status",
    [
        (ValidationError("bad"), 422),
        (InputTooLongError("long", input_tokens=9, max_new_tokens=9, limit=10), 422),
        (NotSupportedError("no"), 422),
        (OverloadedError("Model is overloaded"), 429),
        (GenerationError("boom"), 500),
        (UnhealthyError("dead"), 503),
    ],
)
def test_errors_in_lightllm_shape(exc, status):
    response = lightllm_error(exc).response()
    assert response.status_code == status
    assert response.body == json.dumps({"message": exc.message}, separators=(",", ":")).encode()


def test_errors_before_the_handler_are_400():
    response = lightllm_error(RequestSchemaError("parameters.top_p: 2 is greater than the maximum of 1")).response()
    assert response.status_code == 400
    assert response.body == b'{"message":"parameters.top_p: 2 is greater than the maximum of 1"}'
    assert lightllm_error(OverloadedError("Model is overloaded")).status == 429


def test_stream_error_event():
    def last_event(exc):
        return handlers.ERROR_POLICY.error_event(exc, None)

    assert last_event(GenerationError("boom")) == {"message": "boom"}
    assert last_event(KeyError("k")) == {"message": "Internal server error: KeyError"}


class FakeEngine:
    def __init__(self, alive: bool, probe_ok: bool):
        self.alive, self.probe_ok, self.probes = alive, probe_ok, 0

    def healthy(self) -> bool:
        return self.alive

    async def probe(self) -> bool:
        self.probes += 1
        if self.probe_ok is None:
            raise UnhealthyError("the engine failed its probe")
        return self.probe_ok


@pytest.mark.parametrize("alive, probe_ok, status, body", [
    (True, True, 200, b'{"message":"Ok"}'),
    (True, False, 503, b'{"message":"Error"}'),
    (False, True, 503, b'{"message":"Error"}'),
    (True, None, 503, b'{"message":"Error"}'),
])
async def test_health_follows_the_engine_probe(alive, probe_ok, status, body):
    from opentgi.api import runtime
    from opentgi.config import Settings

    engine = FakeEngine(alive, probe_ok)
    runtime.bind(runtime.ServerState(settings=Settings(), engine=engine))  # this test task's context only
    for handler in (handlers.health, handlers.healthz):
        response = await handler()
        assert (response.status_code, response.body) == (status, body)
    head = await handlers.health_head()
    assert (head.status_code, head.body) == (status, b"")
    assert engine.probes == (3 if alive else 0)  # a dead loop is not probed
