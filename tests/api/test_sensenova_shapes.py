"""SenseNova dialect: request rules and response shapes, byte for byte, without an engine."""

from __future__ import annotations

import json

import pytest

from opentgi.api.errors import RequestSchemaError
from opentgi.api.sensenova import handlers, params, shapes
from opentgi.api.sensenova.errors import sensenova_error
from opentgi.engine.errors import GenerationError, InputTooLongError, OverloadedError, UnhealthyError
from opentgi.engine.events import GenerationResult, SequenceResult, Timings, TokenEvent
from opentgi.engine.request import FinishReason
from opentgi.schemas import sensenova as schema


def event(index, text, n, reason=None):
    return TokenEvent(
        index=index, token_id=100 + n, token_text=text, logprob=-1.0, special=False, text_delta=text,
        generated_tokens=n, finish_reason=reason,
    )


def sequence(index, texts, reason):
    return SequenceResult(
        index=index, token_ids=list(range(len(texts))), text="".join(texts), finish_reason=reason, seed=1,
    )


def request(**kw) -> schema.CompletionRequest:
    return schema.CompletionRequest.model_validate({"prompt": "p", "model": "m", **kw})


def test_defaults_follow_the_documentation():
    req = request()
    assert (req.n, req.max_new_tokens, req.repetition_penalty, req.temperature, req.top_p, req.stream) == (
        1, 1024, 1.05, 0.8, 0.7, False,
    )


def test_generation_request_mapping():
    req = request(n=4, temperature=1.3, top_p=0.5, repetition_penalty=1.2, stop="END")
    gen = params.generation_request(req, [1, 2, 3], ["bad", "worse"])
    assert gen.n == 4 and gen.prompt_token_ids == [1, 2, 3]
    assert (gen.sampling.do_sample, gen.sampling.temperature, gen.sampling.top_p) == (True, 1.3, 0.5)
    assert gen.sampling.repetition_penalty == 1.2
    assert gen.stopping.max_new_tokens == 1024 and gen.stopping.stop_sequences == ["END"]
    assert gen.stopping.include_stop_str_in_output is False
    assert gen.stopping.sensitive_words == ["bad", "worse"]
    assert params.generation_request(request(), [1], []).stopping.stop_sequences == []


def test_explicit_max_new_tokens_must_fit_the_context():
    params.check_context(request(max_new_tokens=10), 90, 100)
    with pytest.raises(InputTooLongError, match=r"prompt tokens \(91\) \+ max_new_tokens \(10\) must be <= "):
        params.check_context(request(max_new_tokens=10), 91, 100)
    params.check_context(request(), 91, 100)  # the default runs into the context: `context`


@pytest.mark.parametrize(
    "reason, expected",
    [
        (FinishReason.EOS_TOKEN, "stop"),
        (FinishReason.STOP_SEQUENCE, "stop"),
        (FinishReason.GRAMMAR, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.CONTEXT, "context"),
        (FinishReason.SENSITIVE, "sensitive"),
    ],
)
def test_finish_reasons(reason, expected):
    assert shapes.sensenova_finish_reason(reason) == expected


def test_completion_response_bytes():
    res = GenerationResult(
        request_id="r", prompt_token_ids=[1, 2, 3, 4, 5, 6], timings=Timings(queued_at=0.0),
        sequences=[sequence(1, ["x"], FinishReason.SENSITIVE), sequence(0, ["a", "b"], FinishReason.LENGTH)],
    )
    body = shapes.dumps(shapes.completion_response(res, "abc"))
    assert body == (
        '{"data":{"id":"abc","choices":[{"index":0,"text":"ab","finish_reason":"length"},'
        '{"index":1,"text":"x","finish_reason":"sensitive"}],'
        '"usage":{"prompt_tokens":6,"completion_tokens":3,"total_tokens":9}}}'
    )


def test_stream_chunks_bytes_usage_on_the_last_chunk_only():
    encoder = shapes.ChunkEncoder("123456789012345", 6, 2)
    chunks = [
        encoder.encode(event(0, "This", 1)),
        encoder.encode(event(1, "Is", 1, FinishReason.EOS_TOKEN)),
        encoder.encode(event(0, "!", 2, FinishReason.LENGTH)),
    ]
    assert chunks[0] == (
        '{"data":{"id":"123456789012345","choices":[{"index":0,"delta":"This","finish_reason":""}],'
        '"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}},'
        '"status":{"code":0,"message":"ok"}}'
    )
    middle = json.loads(chunks[1])["data"]
    assert middle["choices"] == [{"index": 1, "delta": "Is", "finish_reason": "stop"}]
    assert middle["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    assert chunks[2] == (
        '{"data":{"id":"123456789012345","choices":[{"index":0,"delta":"!","finish_reason":"length"}],'
        '"usage":{"prompt_tokens":6,"completion_tokens":3,"total_tokens":9}},'
        '"status":{"code":0,"message":"ok"}}'
    )


def test_stream_chunk_context_reason():
    encoder = shapes.ChunkEncoder("i", 3, 1)
    assert json.loads(encoder.encode(event(0, "z", 1, FinishReason.CONTEXT)))["data"]["choices"][0][
        "finish_reason"
    ] == "context"


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (InputTooLongError("too long", input_tokens=5, max_new_tokens=5, limit=8), 422, 3),
        (OverloadedError("Model is overloaded"), 429, 8),
        (GenerationError("boom"), 500, 13),
        (UnhealthyError("down"), 503, 14),
    ],
)
def test_errors_in_sensenova_shape(exc, status, code):
    response = sensenova_error(exc).response()
    assert response.status_code == status
    assert response.body.decode() == (
        f'{{"error":{{"code":{code},"message":"{exc.message}","details":[]}}}}'
    )


def test_errors_before_the_handler_are_400():

    response = sensenova_error(RequestSchemaError("n: 5 is greater than the maximum of 4")).response()
    assert response.status_code == 400
    assert response.body == (
        b'{"error":{"code":3,"message":"invalid argument: n: 5 is greater than the maximum of 4","details":[]}}'
    )
    assert sensenova_error(OverloadedError("Model is overloaded")).status == 429


def test_stream_error_event():
    assert handlers.ERROR_POLICY.error_event(GenerationError("boom"), None) == {
        "error": {"code": 13, "message": "boom", "details": []}
    }
