"""LightLLM's HTTP API (openapi/lightllm.yaml): thin handlers, LightLLM's names and shapes.

Request: LightLLM's `parameters` -> one engine `GenerationRequest`. Responses are serialized the way
LightLLM's server writes them: `json.dumps(..., ensure_ascii=False)` for /generate, /generate_stream
and /get_score, starlette's compact JSONResponse for /health, /token_load and errors.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse, Response

from opentgi.api import generation as request_path
from opentgi.api import runtime
from opentgi.api.errors import JSONError, RequestSchemaError, StatusError
from opentgi.api.generation import Generation, Prepare, Shape
from opentgi.engine.errors import (
    GenerationError,
    InputTooLongError,
    NotSupportedError,
    OpenTGIError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)
from opentgi.engine.events import GenerationResult, SequenceResult, TokenEvent
from opentgi.engine.request import FinishReason, GenerationRequest, SamplingParams, StoppingParams
from opentgi.schemas import lightllm as schema

# LightLLM turns sampling off below this temperature (py_sampling_params._SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Score requests generate nothing: one prefill pass through the reward model.
SCORE_MAX_NEW_TOKENS = 1

# A well-formed request the server cannot serve is a 422; one that breaks the document is a 400
# (`request_error`).
ERROR_STATUS = (
    (ValidationError, 422),
    (OverloadedError, 429),
    (GenerationError, 500),
    (UnhealthyError, 503),
)


# --- request ----------------------------------------------------------------------------------


def lightllm_finish_reason(reason: FinishReason) -> str:
    """LightLLM knows two reasons: "length" (out of tokens or context) and "stop" (anything else)."""
    return "length" if reason in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"


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


def parse_generate(body: dict) -> tuple[schema.GenerateRequest, schema.GenerateParameters]:
    request = schema.GenerateRequest.model_validate(body)
    return request, request.parameters or schema.GenerateParameters()


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


# --- responses --------------------------------------------------------------------------------


def dumps(payload: dict) -> str:
    """LightLLM's own serialization of generation answers (spaces after separators)."""
    return json.dumps(payload, ensure_ascii=False)


def token_detail(event: TokenEvent, prompt_tokens: int) -> schema.TokenDetail:
    return schema.TokenDetail(
        id=event.token_id,
        text=event.text_delta,
        logprob=event.logprob,
        special=event.special,
        count_output_tokens=event.generated_tokens,
        prompt_tokens=prompt_tokens,
    )


def generate_response(result: GenerationResult, return_details: bool = False) -> dict:
    """`generated_text` is always a list; counts, reasons (and tokens) are lists only for n > 1."""
    sequences: list[SequenceResult] = sorted(result.sequences, key=lambda s: s.index)
    prompt_tokens = len(result.prompt_token_ids)
    one = len(sequences) == 1

    def per_sequence(values: list):
        return values[0] if one else values

    response = schema.GenerateResponse(
        generated_text=[s.text for s in sequences],
        count_output_tokens=per_sequence([s.generated_tokens for s in sequences]),
        finish_reason=per_sequence([schema.FinishReason(lightllm_finish_reason(s.finish_reason)) for s in sequences]),
        prompt_tokens=prompt_tokens,
        tokens=per_sequence([[token_detail(t, prompt_tokens) for t in s.tokens] for s in sequences])
        if return_details
        else None,
    )
    return response.model_dump(mode="json", exclude_none=True)


def stream_event(event: TokenEvent, prompt_tokens: int) -> str:
    """The data of one /generate_stream event."""
    finished = event.finish_reason is not None
    data = schema.StreamToken(
        token=token_detail(event, prompt_tokens),
        generated_text=None,
        finished=finished,
        finish_reason=lightllm_finish_reason(event.finish_reason) if finished else None,
        details=None,
    )
    return dumps(data.model_dump(mode="json"))


def score_response(result: GenerationResult) -> dict:
    if result.score is None:
        raise GenerationError("the engine returned no score for a score request")
    return schema.ScoreResponse(
        score=float(result.score),
        prompt_tokens=len(result.prompt_token_ids),
        finish_reason=schema.ScoreFinishReason.stop,
    ).model_dump(mode="json")


def compute_token_load(stats, pool_tokens: int) -> dict:
    """/token_load from engine.stats(), as fractions of the KV pool (max_batch_total_tokens).

    current_load: tokens held by running requests (evictable cached prefixes do not count).
    dynamic_max_load: the running batch's peak (each request: held now + what it may still generate).
    logical_max_load: LightLLM sets it to dynamic_max_load (router/token_load.py).
    """
    pool = max(int(pool_tokens), 1)
    dynamic = stats.peak_tokens_running / pool
    return schema.TokenLoad(
        current_load=stats.tokens_held_running / pool,
        logical_max_load=dynamic,
        dynamic_max_load=dynamic,
    ).model_dump(mode="json")


def error_status(exc: BaseException) -> int:
    if isinstance(exc, RequestSchemaError):  # the body breaks the document
        return 400
    if isinstance(exc, StatusError):  # refused at the HTTP level (413, 415, 404, 405)
        return exc.status
    for error_type, status in ERROR_STATUS:
        if isinstance(exc, error_type):
            return status
    return 500


def error_shape(exc: BaseException) -> JSONError:
    """LightLLM's one error shape, `{"message": ...}`: for handlers, the app's error mapper, auth
    and a stream's last event alike."""
    message = exc.message if isinstance(exc, OpenTGIError) else f"Internal server error: {type(exc).__name__}"
    return JSONError(error_status(exc), {"message": message}, dict(getattr(exc, "headers", None) or {}))


def error_event(exc: BaseException) -> dict:
    """The last event of a stream that failed after it opened."""
    return error_shape(exc).body


def error_response(exc: BaseException) -> Response:
    return error_shape(exc).response()


def request_error(exc: OpenTGIError) -> Response:
    """An error raised before the handler ran (the app's error mapper calls this)."""
    return error_response(exc)


SHAPE = Shape(error=error_shape)


def json_answer(payload: dict) -> Response:
    return Response(content=dumps(payload).encode("utf-8"), media_type="application/json")


# --- handlers (operationIds) ------------------------------------------------------------------


async def _is_healthy() -> bool:
    """The engine loop is alive and a one-token generation goes through it."""
    engine = runtime.engine()
    if not engine.healthy() or runtime.state().drain.draining:  # shutting down: no more traffic
        return False
    try:
        return await engine.probe()
    except OpenTGIError:
        return False


async def health():
    ok = await _is_healthy()
    return JSONResponse({"message": "Ok" if ok else "Error"}, status_code=200 if ok else 503)


async def health_head():
    return Response(status_code=200 if await _is_healthy() else 503)


async def healthz():
    return await health()


async def token_load():
    engine = runtime.engine()
    return JSONResponse(compute_token_load(engine.stats(), engine.info.max_batch_total_tokens))


def _prepare_generate(body: dict, *, stream: bool) -> Prepare:
    async def prepare():
        engine = runtime.engine()
        request, params = parse_generate(body)
        check_text_only(request.multimodal_params, engine.info.model_id)
        if stream and num_sequences(params) != 1:
            raise ValidationError("stream api only support best_of == 1")
        prompt_token_ids = await engine.encode(request.inputs, max_tokens=engine.info.max_input_tokens)
        check_lengths(len(prompt_token_ids), params.max_new_tokens, engine.info.max_input_tokens,
                      engine.info.max_total_tokens)
        generation = generation_request(prompt_token_ids, params, _Vocabulary(engine), stream=stream)
        return [generation], (params, len(prompt_token_ids))

    return prepare


class _Vocabulary:
    """What token-id stop sequences need of the engine: its vocabulary size and decoding."""

    def __init__(self, engine):
        self.engine = engine

    def __len__(self) -> int:
        return self.engine.info.vocab_size

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.engine.decode(list(ids), skip_special_tokens=skip_special_tokens)


async def generate(body: dict):
    def answer(gen: Generation, results: list[GenerationResult]) -> Response:
        params, _ = gen.context
        return json_answer(generate_response(results[0], return_details=params.return_details))

    return await request_path.generate(_prepare_generate(body, stream=False), SHAPE, answer)


async def _stream_events(gen: Generation):
    _, prompt_tokens = gen.context
    async for event in gen.handle:
        yield stream_event(event, prompt_tokens)
    result = await gen.handle.result()
    gen.success(result.generated_tokens, result.timings)


async def generate_stream(body: dict):
    return await request_path.stream(_prepare_generate(body, stream=True), SHAPE, _stream_events)


async def get_score(body: dict):
    async def prepare():
        engine = runtime.engine()
        request = schema.ScoreRequest.model_validate(body)
        check_text_only(request.multimodal_params, engine.info.model_id)
        if not engine.info.is_reward_model:
            raise NotSupportedError(
                f"/get_score needs a reward model; the served model {engine.info.model_id} is not one"
            )
        prompt_token_ids = await engine.encode(request.chat, max_tokens=engine.info.max_total_tokens)
        return [GenerationRequest(
            prompt_token_ids=prompt_token_ids,
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=SCORE_MAX_NEW_TOKENS),
            score=True,
        )], None

    def answer(gen: Generation, results: list[GenerationResult]) -> Response:
        return json_answer(score_response(results[0]))

    return await request_path.generate(prepare, SHAPE, answer)
