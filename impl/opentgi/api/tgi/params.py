"""TGI's parameter semantics as pure functions: a TGI request body -> one engine `GenerationRequest`.

Mirrors TGI 2.1's router (`router/src/validation.rs`, `server.rs`): the same defaults (those of its
code, not of its OpenAPI document), the same order of checks and the same messages. Validation runs
in two steps because the second needs the prompt's tokens:

    params = check_parameters(inputs, parameters, limits, stream=...)   # no tokenizer needed
    token_ids = await engine.encode(inputs)
    request = build_request(params, token_ids, limits)                   # truncation, length checks

Every failure is an `opentgi.engine.errors.ValidationError` carrying TGI's message without the
"Input validation error: " prefix (the TGI error mapping adds it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jsonschema
import numpy

from opentgi.api.body_validation import BodySchemaError
from opentgi.api.errors import DeserializationError, FieldLimits, tgi_field_message
from opentgi.engine.errors import NotSupportedError, ValidationError
from opentgi.engine.request import GenerationRequest, GrammarSpec, SamplingParams, StoppingParams
from opentgi.engine.sampling.grammar_bounds import MAX_SCHEMA_CHARS
from opentgi.engine.sampling.grammar_bounds import check_bounds as check_grammar_bounds
from opentgi.schemas.tgi import GenerateParameters

DEFAULT_MAX_NEW_TOKENS = 100  # TGI 2.1's `default_max_new_tokens()`

# Integer widths of TGI's Rust types: a value past them fails deserialization there (422).
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
INTEGER_WIDTHS = {"best_of": ("usize", U64_MAX), "max_new_tokens": ("u32", U32_MAX),
                  "seed": ("u64", U64_MAX), "top_k": ("i32", 2**31 - 1),
                  "top_n_tokens": ("u32", U32_MAX), "truncate": ("usize", U64_MAX)}


@dataclass(frozen=True)
class Limits:
    """The router limits in force (Settings, with the engine's derived token limits)."""

    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    disable_grammar_support: bool = False

    @classmethod
    def from_settings(cls, settings, info) -> Limits:
        return cls(max_best_of=settings.max_best_of, max_stop_sequences=settings.max_stop_sequences,
                   max_top_n_tokens=settings.max_top_n_tokens, max_input_tokens=info.max_input_tokens,
                   max_total_tokens=info.max_total_tokens,
                   disable_grammar_support=settings.disable_grammar_support)


@dataclass
class TGIParameters:
    """Checked parameters, before the prompt is tokenized."""

    inputs: str
    best_of: int
    sampling: SamplingParams
    max_new_tokens: int | None  # None: as many as fit (explicit `"max_new_tokens": null`)
    stop: list[str] = field(default_factory=list)
    truncate: int | None = None
    top_n_tokens: int = 0
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    grammar: GrammarSpec | None = None
    stream: bool = True  # every /generate_stream event shows `token.logprob`

    @property
    def needs_logprobs(self) -> bool:
        """Whether the answer shows the generated tokens' logprobs or ranks by them: a stream's
        `token`, `details` (tokens, best_of_sequences), decoder_input_details (it shows `details`
        too), top_n_tokens, and best_of's choice of the highest mean logprob."""
        return (self.stream or self.details or self.decoder_input_details or self.top_n_tokens > 0
                or self.best_of > 1)


def f32(value: float) -> float:
    """TGI reads these parameters as Rust f32: 1e-50 becomes 0.0, 0.9999999999 becomes 1.0."""
    with numpy.errstate(over="ignore"):
        return float(numpy.float32(value))


def default_parameters() -> GenerateParameters:
    """TGI's `default_parameters()`: the parameters of a request without a `parameters` object."""
    return GenerateParameters(do_sample=True, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)


def check_integer_widths(parameters: dict | None) -> None:
    """A value too wide for TGI's Rust field fails there at deserialization (422), never a 500 here."""
    for name, (rust_type, maximum) in INTEGER_WIDTHS.items():
        value = (parameters or {}).get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > maximum:
            raise DeserializationError(f"parameters.{name}: invalid value: integer `{value}`, expected {rust_type}")


def check_parameters(inputs: str, parameters: GenerateParameters | None, limits: Limits, *,
                     stream: bool = False, best_of_allowed: bool = True) -> TGIParameters:
    """TGI's checks that need no tokenizer, in TGI's order."""
    p = parameters if parameters is not None else default_parameters()
    best_of = p.best_of if p.best_of is not None else 1  # 0 is one plain generation (TGI: best_of > 1 only)

    # generate_stream_internal refuses these before validation proper.
    if stream and best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if stream and p.decoder_input_details:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
    # generate_best_of: validate_best_of, before validate().
    if best_of > 1:
        if limits.max_best_of == 1 or not best_of_allowed:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        if best_of > limits.max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")
    best_of = max(best_of, 1)

    # validate(): sampling must be on when best_of > 1.
    sampling_requested = (p.do_sample or p.temperature is not None or p.top_k is not None
                          or p.top_p is not None or p.typical_p is not None)
    if best_of > 1 and not sampling_requested:
        raise ValidationError("you must use sampling when `best_of` is > 1")

    temperature = 1.0 if p.temperature is None else f32(p.temperature)
    if temperature <= 0.0:
        raise ValidationError("`temperature` must be strictly positive")
    repetition_penalty = 1.0 if p.repetition_penalty is None else f32(p.repetition_penalty)
    if repetition_penalty <= 0.0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    frequency_penalty = 0.0 if p.frequency_penalty is None else f32(p.frequency_penalty)
    if not -2.0 <= frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    top_p = 1.0
    if p.top_p is not None:
        top_p = f32(p.top_p)
        if top_p <= 0.0 or top_p >= 1.0:
            raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    typical_p = 1.0
    if p.typical_p is not None:
        typical_p = f32(p.typical_p)
        if typical_p <= 0.0 or typical_p >= 1.0:
            raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    min_p = 0.0  # an extension (vLLM's): TGI has no min_p
    if p.min_p is not None:
        min_p = f32(p.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValidationError("`min_p` must be >= 0.0 and <= 1.0")
    top_k = 0
    if p.top_k is not None:
        if p.top_k <= 0:
            raise ValidationError("`top_k` must be strictly positive")
        top_k = p.top_k

    # An explicit null asks for as many tokens as fit; a missing key means TGI's default.
    max_new_tokens = p.max_new_tokens if "max_new_tokens" in p.model_fields_set else DEFAULT_MAX_NEW_TOKENS
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")

    stop = list(p.stop or [])
    if len(stop) > limits.max_stop_sequences:
        raise ValidationError(
            f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(stop)}")

    if p.seed is not None and best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1")

    top_n_tokens = 0
    if p.top_n_tokens is not None:
        if not 0 <= p.top_n_tokens <= limits.max_top_n_tokens:
            raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
                                  f"Given: {p.top_n_tokens}")
        top_n_tokens = p.top_n_tokens

    if not inputs:
        raise ValidationError("`inputs` cannot be empty")

    truncate = p.truncate
    if truncate is not None and (truncate <= 0 or truncate > limits.max_input_tokens):
        raise ValidationError(f"`truncate` must be strictly positive and less than "
                              f"{limits.max_input_tokens}. Given: {truncate}")

    # TGI's Python server samples when do_sample is set or any warper changes the distribution.
    warpers = temperature != 1.0 or top_k != 0 or top_p < 1.0 or typical_p < 1.0 or min_p > 0.0
    sampling = SamplingParams(
        do_sample=bool(p.do_sample or warpers), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        typical_p=typical_p, repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty, seed=p.seed, watermark=bool(p.watermark))
    return TGIParameters(
        inputs=inputs, best_of=best_of, sampling=sampling, max_new_tokens=max_new_tokens, stop=stop,
        truncate=truncate, top_n_tokens=top_n_tokens, details=bool(p.details),
        decoder_input_details=bool(p.decoder_input_details),
        return_full_text=bool(p.return_full_text), grammar=None, stream=stream)


# TGI's generation operations (as Connexion resolves them): whether they stream (compat_generate:
# the body's `stream` says)
GENERATE_OPERATIONS = {"opentgi.api.tgi.handlers.generate": False, "opentgi.api.tgi.handlers.generate_stream": True,
                       "opentgi.api.tgi.handlers.compat_generate": None}


def refusal_in_tgi_order(operation_id: str | None, exc: BodySchemaError,
                         limits: FieldLimits) -> ValidationError | None:
    """A body whose parameters break only the document's ranges, refused as TGI refuses it: its own
    checks in its own order, where the streaming and best_of ones (no schema states them) come
    before any range. None when the body fails otherwise (serde would reject it first)."""
    if operation_id not in GENERATE_OPERATIONS or not isinstance(exc.body, dict):
        return None
    if any(tgi_field_message(error, limits) is None for error in exc.all_errors):
        return None
    body = exc.body
    stream = GENERATE_OPERATIONS[operation_id]
    if stream is None:
        stream = body.get("stream") is True
    raw = body.get("parameters")
    parameters = GenerateParameters.model_construct(**raw) if isinstance(raw, dict) else None
    inputs = body.get("inputs")
    try:
        check_parameters(inputs if isinstance(inputs, str) else "", parameters,
                         Limits(max_best_of=limits.max_best_of, max_stop_sequences=limits.max_stop_sequences,
                                max_top_n_tokens=limits.max_top_n_tokens, max_input_tokens=limits.max_input_tokens,
                                max_total_tokens=0), stream=stream)
    except ValidationError as refusal:
        return refusal
    return None


def check_grammar(params: TGIParameters, parameters: GenerateParameters | None, limits: Limits) -> None:
    """TGI validates the grammar after the prompt's length; `build_request` calls this in that order."""
    grammar = parameters.grammar if parameters is not None else None
    if grammar is None:
        return
    if limits.disable_grammar_support:
        raise NotSupportedError("grammar is not supported")
    if grammar.type == "regex":
        params.grammar = GrammarSpec(type="regex", value=grammar.value)
        check_grammar_bounds(params.grammar)
        return
    value = grammar.value
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:  # bounded before it is parsed
            raise ValidationError(f"grammar is not valid: the JSON schema has {len(value)} characters; "
                                  f"at most {MAX_SCHEMA_CHARS} are allowed")
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"grammar is not valid: {exc}") from exc
    if not isinstance(value, dict):
        raise ValidationError("grammar is not supported")
    check_grammar_bounds(GrammarSpec(type="json", value=value))  # before the meta-schema check
    try:
        jsonschema.Draft202012Validator.check_schema(value)
    except jsonschema.SchemaError as exc:
        raise ValidationError(f"grammar is not valid: {exc.message}") from exc
    params.grammar = GrammarSpec(type="json", value=json.dumps(value, separators=(",", ":")))


def build_request(params: TGIParameters, prompt_token_ids: list[int], limits: Limits,
                  parameters: GenerateParameters | None = None) -> GenerationRequest:
    """Truncate the prompt, apply TGI's token-length checks and build the engine request."""
    input_length = len(prompt_token_ids)
    if params.truncate is not None:
        input_length = min(input_length, params.truncate)
    if params.max_new_tokens is None:
        max_new_tokens = max(limits.max_total_tokens - input_length, 0)
    else:
        max_new_tokens = params.max_new_tokens
    if input_length + max_new_tokens > limits.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
    if input_length > limits.max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {limits.max_input_tokens} tokens. "
                              f"Given: {input_length}")
    check_grammar(params, parameters, limits)
    kept = prompt_token_ids[len(prompt_token_ids) - input_length:]
    return GenerationRequest(
        prompt_token_ids=list(kept),
        sampling=params.sampling,
        stopping=StoppingParams(max_new_tokens=max_new_tokens, stop_sequences=list(params.stop),
                                include_stop_str_in_output=True),
        n=params.best_of,
        top_n_tokens=params.top_n_tokens,
        prompt_logprobs=params.decoder_input_details,
        needs_logprobs=params.needs_logprobs,
        grammar=params.grammar,
        adapter_id=parameters.adapter_id if parameters is not None else None,
    )
