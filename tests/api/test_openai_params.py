"""OpenAI request fields -> engine parameters (opentgi.api.openai.params)."""

from __future__ import annotations

import json

import pytest

from opentgi.api.openai.params import (
    OpenAILimits,
    check_n,
    check_seed,
    check_top_logprobs,
    logit_bias_map,
    max_new_tokens,
    response_format_grammar,
    sampling_params,
    stop_sequences,
    stopping_params,
)
from opentgi.engine.errors import InputTooLongError, NotSupportedError, ValidationError

LIMITS = OpenAILimits(max_stop_sequences=4, max_top_n_tokens=5, max_client_batch_size=4, max_input_tokens=100,
                      max_total_tokens=128, vocab_size=1000)


def _sampling(**kwargs):
    base = {"temperature": None, "top_p": None, "frequency_penalty": None, "presence_penalty": None, "seed": None,
            "logit_bias": None, "limits": LIMITS}
    return sampling_params(**{**base, **kwargs})


def test_defaults_sample_at_temperature_one_and_zero_is_greedy():
    default = _sampling()
    assert default.do_sample and default.temperature == 1.0 and default.top_p == 1.0
    greedy = _sampling(temperature=0)
    assert not greedy.do_sample
    assert _sampling(top_p=1.0).top_p == 1.0  # TGI 2.1 refuses 1.0; OpenAI clients send it


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_sampling_ranges(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        _sampling(**kwargs)


def test_penalties_seed_and_logit_bias_reach_the_engine():
    params = _sampling(frequency_penalty=0.5, presence_penalty=-0.5, seed=3, logit_bias={"7": -100, "9": 2.5})
    assert (params.frequency_penalty, params.presence_penalty, params.seed) == (0.5, -0.5, 3)
    assert params.logit_bias == {7: -100.0, 9: 2.5}


@pytest.mark.parametrize("bias,match", [
    ({"x": 1}, "not a token id"),
    ({"1000": 1}, "out of the vocabulary"),
    ({"5": 101}, "between -100 and 100"),
    ([1.0, 2.0], "must be an object"),
])
def test_logit_bias_errors(bias, match):
    with pytest.raises(ValidationError, match=match):
        logit_bias_map(bias, LIMITS)


def test_empty_logit_bias_forms_mean_none():
    assert logit_bias_map([], LIMITS) is None and logit_bias_map({}, LIMITS) is None


def test_stop_string_or_list_and_limit():
    assert stop_sequences("\n", LIMITS) == ["\n"]
    assert stop_sequences(["a", "b"], LIMITS) == ["a", "b"]
    assert stop_sequences(None, LIMITS) == []
    with pytest.raises(ValidationError, match="up to 4"):
        stop_sequences(list("abcde"), LIMITS)
    assert stopping_params(5, ["x"]).include_stop_str_in_output is False


def test_n_and_top_logprobs_limits():
    assert check_n(None, LIMITS) == 1 and check_n(4, LIMITS) == 4
    for bad in (0, 5):
        with pytest.raises(ValidationError, match="`n`"):
            check_n(bad, LIMITS)
    assert check_top_logprobs("top_logprobs", None, LIMITS) == 0
    with pytest.raises(ValidationError, match="top_logprobs"):
        check_top_logprobs("top_logprobs", 6, LIMITS)


def test_max_tokens_default_is_capped_explicit_is_checked():
    assert max_new_tokens(None, 100, 10, LIMITS) == 100
    assert max_new_tokens(None, 100, 90, LIMITS) == 38  # what still fits in max_total_tokens
    assert max_new_tokens(20, 100, 90, LIMITS) == 20
    with pytest.raises(InputTooLongError, match="must be <= 128. Given: 90 `inputs` tokens and 50"):
        max_new_tokens(50, 100, 90, LIMITS)
    with pytest.raises(InputTooLongError, match="less than 100 tokens. Given: 101"):
        max_new_tokens(None, 100, 101, LIMITS)
    with pytest.raises(InputTooLongError, match="Given: 128 `inputs` tokens and 1 `max_new_tokens`"):
        max_new_tokens(None, 100, 128, LIMITS)
    with pytest.raises(ValidationError, match="strictly positive"):
        max_new_tokens(0, 100, 10, LIMITS)


def test_response_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format_grammar(None, LIMITS) is None
    assert response_format_grammar({"type": "text"}, LIMITS) is None
    tgi_json = response_format_grammar({"type": "json", "value": schema}, LIMITS)
    assert tgi_json.type == "json" and json.loads(tgi_json.value) == schema
    assert response_format_grammar({"type": "json", "value": json.dumps(schema)}, LIMITS).value == json.dumps(schema)
    assert response_format_grammar({"type": "regex", "value": "a+"}, LIMITS).value == "a+"
    assert json.loads(response_format_grammar({"type": "json_object"}, LIMITS).value) == {"type": "object"}
    openai_schema = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                                            LIMITS)
    assert json.loads(openai_schema.value) == schema
    with pytest.raises(ValidationError, match="response_format.type"):
        response_format_grammar({"type": "yaml"}, LIMITS)
    no_grammar = OpenAILimits(**{**LIMITS.__dict__, "disable_grammar_support": True})
    with pytest.raises(NotSupportedError, match="^grammar is not supported$"):  # TGI's exact text
        response_format_grammar({"type": "json_object"}, no_grammar)


def test_seed_is_a_u64_for_every_choice():
    check_seed(None, 3)
    check_seed(2**64 - 3, 3)
    with pytest.raises(ValidationError, match="seed"):
        check_seed(2**64 - 2, 3)
    with pytest.raises(ValidationError, match="seed"):
        check_seed(-1, 1)
