"""TGI's parameter semantics (opentgi.api.tgi.params): defaults, every message, and their order."""

from __future__ import annotations

import pytest

from opentgi.api.tgi.params import (
    DEFAULT_MAX_NEW_TOKENS,
    Limits,
    build_request,
    check_integer_widths,
    check_parameters,
)
from opentgi.engine.errors import NotSupportedError, ValidationError
from opentgi.schemas.tgi import GenerateParameters

LIMITS = Limits(max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=10,
                max_total_tokens=16)


def params(**values) -> GenerateParameters:
    return GenerateParameters.model_validate(values)


def message_of(inputs="Hello", parameters=None, *, stream=False, limits=LIMITS, tokens=(1, 2, 3)) -> str:
    with pytest.raises(ValidationError) as caught:
        checked = check_parameters(inputs, parameters, limits, stream=stream)
        build_request(checked, list(tokens), limits, parameters)
    return caught.value.message


# --- defaults -----------------------------------------------------------------------------------


def test_without_parameters_tgi_samples_and_generates_100_tokens():
    checked = check_parameters("Hi", None, LIMITS)
    assert checked.sampling.do_sample is True
    assert checked.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert checked.details is False and checked.best_of == 1


def test_with_parameters_defaults_are_greedy_and_100_tokens():
    checked = check_parameters("Hi", params(), LIMITS)
    assert checked.sampling.do_sample is False
    assert checked.max_new_tokens == 100
    assert (checked.details, checked.decoder_input_details, checked.top_n_tokens) == (False, False, 0)
    assert checked.sampling.seed is None


def test_explicit_null_max_new_tokens_takes_what_fits():
    limits = Limits(2, 4, 5, max_input_tokens=10, max_total_tokens=16)
    checked = check_parameters("Hi", params(max_new_tokens=None), limits)
    request = build_request(checked, [5, 6, 7], limits)
    assert request.stopping.max_new_tokens == 13


@pytest.mark.parametrize("warper", [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}, {"typical_p": 0.9}])
def test_any_warper_turns_sampling_on(warper):
    assert check_parameters("Hi", params(**warper), LIMITS).sampling.do_sample is True


def test_temperature_one_alone_stays_greedy():
    assert check_parameters("Hi", params(temperature=1.0), LIMITS).sampling.do_sample is False


def test_request_carries_every_parameter():
    p = params(max_new_tokens=5, best_of=2, do_sample=True, stop=["x"], top_n_tokens=3, watermark=True,
               decoder_input_details=True, repetition_penalty=1.2, frequency_penalty=0.5)
    request = build_request(check_parameters("Hi", p, LIMITS), [1, 2], LIMITS, p)
    assert request.n == 2 and request.top_n_tokens == 3 and request.prompt_logprobs
    assert request.stopping.stop_sequences == ["x"] and request.stopping.include_stop_str_in_output
    assert request.sampling.watermark and request.sampling.repetition_penalty == pytest.approx(1.2)
    assert request.sampling.frequency_penalty == 0.5


def test_truncate_keeps_the_last_tokens():
    p = params(truncate=2, max_new_tokens=3)
    request = build_request(check_parameters("Hi", p, LIMITS), [1, 2, 3, 4], LIMITS, p)
    assert request.prompt_token_ids == [3, 4]


def test_grammar_json_object_is_serialized_and_regex_kept():
    p = params(max_new_tokens=3, grammar={"type": "json", "value": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    request = build_request(check_parameters("Hi", p, LIMITS), [1], LIMITS, p)
    assert request.grammar.type == "json"
    assert request.grammar.value == '{"type":"object","properties":{"a":{"type":"integer"}}}'
    p = params(max_new_tokens=3, grammar={"type": "regex", "value": "[0-9]+"})
    assert build_request(check_parameters("Hi", p, LIMITS), [1], LIMITS, p).grammar.value == "[0-9]+"


# --- messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "expected"), [
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"temperature": 1e-50}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 1e-50}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.99999999999}, "`top_p` must be > 0.0 and < 1.0"),  # 1.0 as TGI's f32
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": 11}, "`truncate` must be strictly positive and less than 10. Given: 11"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 10. Given: 0"),
    ({"max_new_tokens": 14}, ("`inputs` tokens + `max_new_tokens` must be <= 16. Given: 3 `inputs` tokens "
                              "and 14 `max_new_tokens`")),
])
def test_validation_messages(values, expected):
    assert message_of(parameters=params(**values)) == expected


def test_stop_count():
    limits = Limits(2, max_stop_sequences=1, max_top_n_tokens=5, max_input_tokens=10, max_total_tokens=16)
    assert message_of(parameters=params(stop=["a", "b"]), limits=limits) == \
        "`stop` supports up to 1 stop sequences. Given: 2"


def test_empty_inputs():
    assert message_of("", params()) == "`inputs` cannot be empty"


def test_input_too_long():
    assert message_of(parameters=params(max_new_tokens=1), tokens=range(11)) == \
        "`inputs` must have less than 10 tokens. Given: 11"


def test_null_max_new_tokens_with_a_prompt_past_the_total():
    assert message_of(parameters=params(max_new_tokens=None), tokens=range(17)) == \
        "`inputs` tokens + `max_new_tokens` must be <= 16. Given: 17 `inputs` tokens and 0 `max_new_tokens`"


def test_best_of_zero_is_one_generation_but_not_streamed():
    """TGI 2.1 checks best_of only when it is > 1 (generate_best_of); streaming refuses any best_of != 1."""
    checked = check_parameters("Hi", params(best_of=0, max_new_tokens=2), LIMITS)
    assert checked.best_of == 1
    assert build_request(checked, [1, 2], LIMITS).n == 1
    assert message_of(parameters=params(best_of=0), stream=True) == \
        "`best_of` != 1 is not supported when streaming tokens"


def test_streaming_only_messages():
    assert message_of(parameters=params(best_of=2), stream=True) == \
        "`best_of` != 1 is not supported when streaming tokens"
    assert message_of(parameters=params(decoder_input_details=True), stream=True) == \
        "`decoder_input_details` == true is not supported when streaming tokens"


def test_grammar_disabled():
    limits = Limits(2, 4, 5, 10, 16, disable_grammar_support=True)
    p = params(max_new_tokens=3, grammar={"type": "regex", "value": "a+"})
    with pytest.raises(NotSupportedError, match="^grammar is not supported$"):
        build_request(check_parameters("Hi", p, limits), [1], limits, p)


def test_invalid_json_grammar():
    p = params(max_new_tokens=3, grammar={"type": "json", "value": "{not json"})
    assert message_of(parameters=p).startswith("grammar is not valid: ")
    p = params(max_new_tokens=3, grammar={"type": "json", "value": {"type": 12}})
    assert message_of(parameters=p).startswith("grammar is not valid: ")


def test_integer_wider_than_tgi_reads():
    with pytest.raises(ValidationError, match="parameters.max_new_tokens: invalid value: integer `4294967296`, "
                                              "expected u32"):
        check_integer_widths({"max_new_tokens": 2**32})
    check_integer_widths({"max_new_tokens": 2**32 - 1, "seed": 2**64 - 1})


# --- order: TGI reports the first failing check -------------------------------------------------------


def test_order_streaming_checks_come_first():
    p = params(best_of=2, temperature=1e-50)
    assert message_of(parameters=p, stream=True) == "`best_of` != 1 is not supported when streaming tokens"


def test_order_best_of_limit_before_sampling():
    assert message_of(parameters=params(best_of=3)) == "`best_of` must be > 0 and <= 2. Given: 3"


@pytest.mark.parametrize(("values", "first"), [
    ({"best_of": 2, "temperature": 1e-50}, "`temperature` must be strictly positive"),  # temperature: sampling
    ({"temperature": 1e-50, "repetition_penalty": 1e-50}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 1e-50, "frequency_penalty": 3}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 3, "top_p": 1.0}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0, "typical_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0, "top_k": None, "max_new_tokens": 0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"max_new_tokens": 0, "top_n_tokens": 9}, "`max_new_tokens` must be strictly positive"),
    ({"best_of": 2, "do_sample": True, "seed": 3, "top_n_tokens": 9}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 9, "truncate": 0}, "`top_n_tokens` must be >= 0 and <= 5. Given: 9"),
])
def test_order(values, first):
    assert message_of(parameters=params(**values)) == first


def test_order_empty_inputs_before_truncate_and_lengths():
    assert message_of("", params(truncate=0)) == "`inputs` cannot be empty"
    p = params(truncate=0)
    assert message_of("Hi", p) == "`truncate` must be strictly positive and less than 10. Given: 0"


def test_order_total_before_input_length():
    assert message_of(parameters=params(max_new_tokens=10), tokens=range(11)).startswith(
        "`inputs` tokens + `max_new_tokens` must be <= 16")


def test_order_lengths_before_grammar():
    limits = Limits(2, 4, 5, 10, 16, disable_grammar_support=True)
    p = params(max_new_tokens=20, grammar={"type": "regex", "value": "a"})
    assert message_of(parameters=p, limits=limits).startswith("`inputs` tokens + `max_new_tokens`")
