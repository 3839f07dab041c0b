"""OpenAI request fields -> engine parameters, for `/v1/chat/completions` and `/v1/completions`.

Pure functions; every failure is an `opentgi.engine.errors.ValidationError` (422) whose message
names the field, in TGI's wording where TGI has one. Differences from TGI 2.1, on purpose:
`top_p` may be 1.0, `n` really samples n choices, `logit_bias` is really applied, and a matched
stop string is left out of the output (OpenAI behaviour).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opentgi.engine.errors import InputTooLongError, NotSupportedError, ValidationError
from opentgi.engine.request import GrammarSpec, SamplingParams, StoppingParams
from opentgi.engine.sampling.grammar_bounds import check_bounds as check_grammar_bounds

# TGI 2.1's code default on both routes (`max_tokens.or(Some(100))`); its document says 32 for
# /v1/completions, which its server never applied.
DEFAULT_MAX_TOKENS = 100
U64_MAX = 2**64 - 1  # TGI's seed is a u64


@dataclass(frozen=True)
class OpenAILimits:
    """The limits in force: Settings plus the engine's derived token limits."""

    max_stop_sequences: int
    max_top_n_tokens: int
    max_client_batch_size: int
    max_input_tokens: int
    max_total_tokens: int
    vocab_size: int
    disable_grammar_support: bool = False

    @classmethod
    def from_settings(cls, settings, info, vocab_size: int) -> OpenAILimits:
        return cls(max_stop_sequences=settings.max_stop_sequences,
                   max_top_n_tokens=settings.max_top_n_tokens,
                   max_client_batch_size=settings.max_client_batch_size,
                   max_input_tokens=info.max_input_tokens, max_total_tokens=info.max_total_tokens,
                   vocab_size=vocab_size, disable_grammar_support=settings.disable_grammar_support)


def _in_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not (low <= value <= high):
        raise ValidationError(f"`{name}` must be >= {low} and <= {high}. Given: {value}")


def stop_sequences(stop: str | list[str] | None, limits: OpenAILimits) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                              f"Given: {len(stops)}")
    if any(s == "" for s in stops):
        raise ValidationError("`stop` sequences must not be empty")
    return stops


def logit_bias_map(logit_bias: Any, limits: OpenAILimits) -> dict[int, float] | None:
    """OpenAI's `{"<token id>": bias}` (bias in [-100, 100]) -> {token id: bias}."""
    if logit_bias is None or logit_bias == [] or logit_bias == {}:
        return None
    if not isinstance(logit_bias, dict):
        raise ValidationError("`logit_bias` must be an object mapping token ids to a bias between "
                              "-100 and 100, e.g. {\"50256\": -100}")
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValidationError(f"`logit_bias`: {key!r} is not a token id") from None
        if not 0 <= token_id < limits.vocab_size:
            raise ValidationError(f"`logit_bias`: token id {token_id} is out of the vocabulary "
                                  f"(0..{limits.vocab_size - 1})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValidationError(f"`logit_bias`: the bias of token {token_id} must be a number "
                                  f"between -100 and 100. Given: {bias}")
        out[token_id] = float(bias)
    return out


def sampling_params(*, temperature: float | None, top_p: float | None,
                    frequency_penalty: float | None, presence_penalty: float | None,
                    seed: int | None, logit_bias: Any, limits: OpenAILimits,
                    repetition_penalty: float | None = None, min_p: float | None = None) -> SamplingParams:
    """OpenAI semantics: sampling at temperature 1 by default, `temperature: 0` is greedy."""
    if temperature is not None and temperature < 0:
        raise ValidationError("`temperature` must be strictly positive")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValidationError("`top_p` must be > 0.0 and <= 1.0")
    _in_range("frequency_penalty", frequency_penalty, -2.0, 2.0)
    _in_range("presence_penalty", presence_penalty, -2.0, 2.0)
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    _in_range("min_p", min_p, 0.0, 1.0)
    greedy = temperature == 0
    return SamplingParams(
        do_sample=not greedy,
        temperature=1.0 if greedy or temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        min_p=float(min_p or 0.0),
        frequency_penalty=float(frequency_penalty or 0.0),
        presence_penalty=float(presence_penalty or 0.0),
        repetition_penalty=float(repetition_penalty or 1.0),
        seed=seed,
        logit_bias=logit_bias_map(logit_bias, limits),
    )


def check_n(n: int | None, limits: OpenAILimits) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= limits.max_client_batch_size:
        raise ValidationError(f"`n` must be >= 1 and <= {limits.max_client_batch_size}. Given: {n}")
    return n


def check_seed(seed: int | None, n: int) -> None:
    """A u64 as in TGI; choice i of n samples with seed + i, which must stay a u64 too."""
    if seed is not None and not 0 <= seed <= U64_MAX - (n - 1):
        raise ValidationError(f"`seed` must be >= 0 and <= {U64_MAX - (n - 1)}. Given: {seed}")


def check_top_logprobs(name: str, value: int | None, limits: OpenAILimits) -> int:
    value = value or 0
    if not 0 <= value <= limits.max_top_n_tokens:
        raise ValidationError(f"`{name}` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {value}")
    return value


def max_new_tokens(requested: int | None, default: int, num_prompt_tokens: int,
                   limits: OpenAILimits) -> int:
    """The token budget, checked in TGI's order and words. An unset `max_tokens` is capped to what
    still fits in max_total_tokens (at least 1)."""
    if requested is not None and requested < 1:
        raise ValidationError("`max_tokens` must be strictly positive")
    budget = max(1, min(default, limits.max_total_tokens - num_prompt_tokens)) if requested is None else requested
    if num_prompt_tokens + budget > limits.max_total_tokens:
        raise InputTooLongError(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. Given: "
            f"{num_prompt_tokens} `inputs` tokens and {budget} `max_new_tokens`",
            input_tokens=num_prompt_tokens, max_new_tokens=budget, limit=limits.max_total_tokens)
    if num_prompt_tokens > limits.max_input_tokens:
        raise InputTooLongError(
            f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {num_prompt_tokens}",
            input_tokens=num_prompt_tokens, max_new_tokens=budget, limit=limits.max_input_tokens)
    return budget


def stopping_params(max_tokens: int, stop: list[str]) -> StoppingParams:
    return StoppingParams(max_new_tokens=max_tokens, stop_sequences=stop,
                          include_stop_str_in_output=False)


def response_format_grammar(response_format: dict | None, limits: OpenAILimits) -> GrammarSpec | None:
    """TGI's `{"type": "json"|"regex", "value": ...}` and OpenAI's `json_object` / `json_schema` /
    `text` forms -> the engine's grammar."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if limits.disable_grammar_support:
        raise NotSupportedError("grammar is not supported")  # TGI's ValidationError::Grammar
    if kind == "json":
        value = response_format.get("value")
        check_grammar_bounds(GrammarSpec("json", value))
        return GrammarSpec("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "regex":
        check_grammar_bounds(GrammarSpec("regex", response_format["value"]))
        return GrammarSpec("regex", response_format["value"])
    if kind == "json_object":
        return GrammarSpec("json", json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema")
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise ValidationError("`response_format.json_schema.schema` must be a JSON schema object")
        check_grammar_bounds(GrammarSpec("json", schema))
        return GrammarSpec("json", json.dumps(schema))
    raise ValidationError(f"`response_format.type` must be one of json, regex, json_object, "
                          f"json_schema, text. Given: {kind!r}")
