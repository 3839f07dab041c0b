"""LightLLM's request semantics: a `GenerateRequest` or `ScoreRequest` -> one engine `GenerationRequest`,
with LightLLM's checks and messages (its `py_sampling_params` and `httpserver` rules)."""

from __future__ import annotations

from opentgi.engine.errors import InputTooLongError, NotSupportedError, ValidationError
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.schemas import lightllm as schema

# LightLLM turns sampling off below this temperature (py_sampling_params._SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Score requests generate nothing: one prefill pass through the reward model.
SCORE_MAX_NEW_TOKENS = 1


def num_sequences(params: schema.GenerateParameters) -> int:
    """`n` defaults to `best_of` and, as in LightLLM, must equal it."""
    if params.n is not None and "best_of" in params.model_fields_set and params.n != params.best_of:
        raise ValidationError(f"current only supported n == best_of, got n={params.n}, best_of={params.best_of}")
    return params.n if params.n is not None else params.best_of


def sampling_params(params: schema.GenerateParameters) -> SamplingParams:
    do_sample = params.do_sample and params.temperature >= SAMPLING_EPS
    return SamplingParams(
        do_sample=do_sample,
        temperature=params.temperature if do_sample else 1.0,
        top_k=0 if params.top_k == -1 else params.top_k,
        top_p=params.top_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        seed=params.seed,
    )


def stop_conditions(stops: str | list | None, tokenizer=None) -> tuple[list[str], list[int]]:
    """LightLLM's `stop_sequences` (a string, strings, or token-id sequences) -> (stop strings,
    stop token ids). A one-id sequence stops on that token; a longer one where its decoded text
    appears. Empty entries are ignored, as in LightLLM."""
    stops = [stops] if isinstance(stops, str) else [s for s in stops or [] if s]
    strings = [s for s in stops if isinstance(s, str)]
    id_sequences = [s for s in stops if not isinstance(s, str)]
    if not id_sequences:
        return strings, []
    vocab_size = len(tokenizer)
    for ids in id_sequences:
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValidationError(
                f"stop_sequences: token id {bad[0]} is not in the vocabulary (0 to {vocab_size - 1})")
    token_ids = [ids[0] for ids in id_sequences if len(ids) == 1]
    texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in id_sequences if len(ids) > 1]
    return strings + [t for t in texts if t], token_ids


def stopping_params(params: schema.GenerateParameters, tokenizer=None) -> StoppingParams:
    """`tokenizer` decodes and checks token-id stop sequences (needed only when there are some)."""
    if params.min_new_tokens > params.max_new_tokens:
        raise ValidationError(
            f"min_new_tokens must <= max_new_tokens, but got min {params.min_new_tokens}, "
            f"max {params.max_new_tokens}."
        )
    stop_sequences, stop_token_ids = stop_conditions(params.stop_sequences, tokenizer)
    return StoppingParams(
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.min_new_tokens,
        stop_sequences=stop_sequences,
        stop_token_ids=stop_token_ids,
        ignore_eos=params.ignore_eos,
    )


def check_lengths(prompt_tokens: int, max_new_tokens: int, max_input_tokens: int, max_total_tokens: int) -> None:
    """LightLLM's limits, in its words: the prompt within the input limit, and prompt +
    max_new_tokens within the request limit (never cut short by the context instead)."""
    if prompt_tokens > max_input_tokens:
        raise InputTooLongError(f"the input prompt token len {prompt_tokens} is too long > {max_input_tokens}",
                                input_tokens=prompt_tokens, max_new_tokens=max_new_tokens, limit=max_input_tokens)
    if prompt_tokens + max_new_tokens > max_total_tokens:
        raise InputTooLongError(
            f"the req token total len (input len + output len) is too long > max_req_total_len:{max_total_tokens}",
            input_tokens=prompt_tokens, max_new_tokens=max_new_tokens, limit=max_total_tokens)


def check_text_only(multimodal: schema.MultimodalParams | None, model_id: str) -> None:
    if multimodal is not None and (multimodal.images or multimodal.audios):
        raise NotSupportedError(
            f"multimodal input (images/audios) is not supported: the served model {model_id} is a text model"
        )


def check_reward_model(info) -> None:
    if not info.is_reward_model:
        raise NotSupportedError(f"/get_score needs a reward model; the served model {info.model_id} is not one")


def parse_generate(body: dict) -> tuple[schema.GenerateRequest, schema.GenerateParameters]:
    request = schema.GenerateRequest.model_validate(body)
    return request, request.parameters or schema.GenerateParameters()


def check_stream(params: schema.GenerateParameters) -> None:
    if num_sequences(params) != 1:
        raise ValidationError("stream api only support best_of == 1")


def generation_request(prompt_token_ids: list[int], params: schema.GenerateParameters,
                       tokenizer=None, *, stream: bool = True) -> GenerationRequest:
    """Every stream event shows its token's logprob; a /generate answer only with return_details."""
    return GenerationRequest(
        prompt_token_ids=prompt_token_ids,
        sampling=sampling_params(params),
        stopping=stopping_params(params, tokenizer),
        n=num_sequences(params),
        needs_logprobs=stream or bool(params.return_details),
    )


def score_request(prompt_token_ids: list[int]) -> GenerationRequest:
    """A /get_score request: the reward model's one prefill pass, nothing sampled."""
    return GenerationRequest(
        prompt_token_ids=prompt_token_ids,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=SCORE_MAX_NEW_TOKENS),
        score=True,
    )


class EngineVocabulary:
    """What token-id stop sequences need of the engine: its vocabulary size and decoding."""

    def __init__(self, engine):
        self.engine = engine

    def __len__(self) -> int:
        return self.engine.info.vocab_size

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.engine.decode(list(ids), skip_special_tokens=skip_special_tokens)
