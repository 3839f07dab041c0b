"""SenseNova's text completion API (openapi/sensenova.yaml): `POST /v1/llm/completions`.

SenseNova's rules on top of the document's ranges: the prompt's tokens plus an explicit
`max_new_tokens` must fit the model's context (a 422 otherwise); with the default `max_new_tokens`
(1024) a choice that runs into the context ends with `context`. The
`n` choices share the prompt's KV blocks (one engine request, n sequences). A choice whose output
would contain a sensitive term (`--sensitive-words`) stops before it with `sensitive`.
"""

from __future__ import annotations

import json
import uuid

from starlette.responses import Response

from opentgi.api import generation as request_path
from opentgi.api import runtime
from opentgi.api.adapters import adapter_named_by_model
from opentgi.api.errors import JSONError, RequestSchemaError, StatusError
from opentgi.api.generation import Generation, Shape
from opentgi.engine.errors import (
    GenerationError,
    InputTooLongError,
    OpenTGIError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)
from opentgi.engine.events import GenerationResult, TokenEvent
from opentgi.engine.request import FinishReason, GenerationRequest, SamplingParams, StoppingParams
from opentgi.schemas import sensenova as schema

# gRPC-style codes of SenseNova's error body {"error": {"code", "message", "details"}}.
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE, UNAUTHENTICATED = 3, 8, 13, 14, 16
# A well-formed request the server cannot serve is a 422; one that breaks the document is a 400
# (`request_error`). Both carry code 3.
ERRORS = (  # engine error type -> (HTTP status, SenseNova code)
    (ValidationError, 422, INVALID_ARGUMENT),
    (OverloadedError, 429, RESOURCE_EXHAUSTED),
    (GenerationError, 500, INTERNAL),
    (UnhealthyError, 503, UNAVAILABLE),
)
DONE = "[DONE]"
OK_STATUS = schema.Status(code=0, message="ok")


def dumps(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def completion_id() -> str:
    return uuid.uuid4().hex


# --- request ----------------------------------------------------------------------------------


def check_context(request: schema.CompletionRequest, prompt_tokens: int, max_total_tokens: int) -> None:
    """An explicit `max_new_tokens` must fit: prompt tokens + max_new_tokens <= the model's context.

    The default (1024) is not checked: a choice that runs into the context ends with `context`.
    """
    explicit = "max_new_tokens" in request.model_fields_set
    if explicit and prompt_tokens + request.max_new_tokens > max_total_tokens:
        raise InputTooLongError(
            f"prompt tokens ({prompt_tokens}) + max_new_tokens ({request.max_new_tokens}) must be "
            f"<= the model's context length ({max_total_tokens})",
            input_tokens=prompt_tokens,
            max_new_tokens=request.max_new_tokens,
            limit=max_total_tokens,
        )


def generation_request(
    request: schema.CompletionRequest, prompt_token_ids: list[int], sensitive_words: list[str]
) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=prompt_token_ids,
        sampling=SamplingParams(
            do_sample=True,
            temperature=request.temperature,
            top_p=request.top_p,
            repetition_penalty=request.repetition_penalty,
        ),
        stopping=StoppingParams(
            max_new_tokens=request.max_new_tokens,
            stop_sequences=[request.stop] if request.stop else [],
            include_stop_str_in_output=False,
            sensitive_words=list(sensitive_words),
        ),
        n=request.n,
        needs_logprobs=False,  # no SenseNova response shows a logprob
    )


# --- responses --------------------------------------------------------------------------------


def sensenova_finish_reason(reason: FinishReason) -> str:
    if reason is FinishReason.CONTEXT:
        return "context"
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.SENSITIVE:
        return "sensitive"
    return "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> schema.Usage:
    return schema.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def completion_response(result: GenerationResult, response_id: str) -> dict:
    sequences = sorted(result.sequences, key=lambda s: s.index)
    prompt_tokens = len(result.prompt_token_ids)
    data = schema.CompletionData(
        id=response_id,
        choices=[
            schema.Choice(
                index=s.index,
                text=s.text,
                finish_reason=sensenova_finish_reason(s.finish_reason),
            )
            for s in sequences
        ],
        usage=usage(prompt_tokens, sum(s.generated_tokens for s in sequences)),
    )
    return schema.CompletionResponse(data=data).model_dump(mode="json")


class ChunkEncoder:
    """Turns a request's token events into SenseNova stream chunks.

    Every event of every choice is one chunk; usage stays zero until the request's last chunk.
    """

    def __init__(self, response_id: str, prompt_tokens: int, n: int):
        self.response_id = response_id
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.generated = [0] * n
        self.finished = 0

    def encode(self, event: TokenEvent) -> str:
        self.generated[event.index] = event.generated_tokens
        reason = ""
        if event.finish_reason is not None:
            self.finished += 1
            reason = sensenova_finish_reason(event.finish_reason)
        last = self.finished == self.n
        chunk = schema.CompletionChunk(
            data=schema.ChunkData(
                id=self.response_id,
                choices=[schema.ChunkChoice(index=event.index, delta=event.text_delta, finish_reason=reason)],
                usage=usage(self.prompt_tokens, sum(self.generated)) if last else usage(0, 0),
            ),
            status=OK_STATUS,
        )
        return dumps(chunk.model_dump(mode="json"))


def error_body(code: int, message: str) -> dict:
    return schema.ErrorResponse(error=schema.ErrorDetail(code=code, message=message, details=[])).model_dump(
        mode="json"
    )


def error_status_code(exc: BaseException) -> tuple[int, int]:
    """(HTTP status, SenseNova code) of an engine error."""
    if isinstance(exc, RequestSchemaError):  # the body breaks the document
        return 400, INVALID_ARGUMENT
    if isinstance(exc, StatusError):  # refused at the HTTP level (401, 413, 415, 404, 405)
        return exc.status, UNAUTHENTICATED if exc.status == 401 else INVALID_ARGUMENT
    for error_type, status, code in ERRORS:
        if isinstance(exc, error_type):
            return status, code
    return 500, INTERNAL


def error_shape(exc: BaseException) -> JSONError:
    """SenseNova's one error shape, `{"error": {"code", "message", "details"}}`: for the handler, the
    app's error mapper, auth and a stream's last event alike."""
    status, code = error_status_code(exc)
    if isinstance(exc, RequestSchemaError):
        message = f"invalid argument: {exc.message}"
    elif isinstance(exc, OpenTGIError):
        message = exc.message
    else:
        message = f"Internal server error: {type(exc).__name__}"
    return JSONError(status, error_body(code, message), dict(getattr(exc, "headers", None) or {}))


def error_event(exc: BaseException) -> dict:
    """The last event of a stream that failed after it opened."""
    return error_shape(exc).body


def error_response(exc: BaseException) -> Response:
    return error_shape(exc).response()


def request_error(exc: OpenTGIError) -> Response:
    """An error raised before the handler ran (the app's error mapper calls this)."""
    return error_response(exc)


SHAPE = Shape(error=error_shape)


# --- handler (operationId) --------------------------------------------------------------------


async def completions(body: dict):
    request = None

    async def prepare():
        nonlocal request
        engine = runtime.engine()
        request = schema.CompletionRequest.model_validate(body)
        prompt_token_ids = await engine.encode(request.prompt, max_tokens=engine.info.max_total_tokens)
        check_context(request, len(prompt_token_ids), engine.info.max_total_tokens)
        generation = generation_request(request, prompt_token_ids, runtime.settings().sensitive_words)
        generation.adapter_id = adapter_named_by_model(engine.info, request.model)  # else the base model
        return [generation], (completion_id(), len(prompt_token_ids))

    def answer(gen: Generation, results: list[GenerationResult]) -> Response:
        response_id, _ = gen.context
        return Response(dumps(completion_response(results[0], response_id)), media_type="application/json")

    async def chunks(gen: Generation):
        response_id, prompt_tokens = gen.context
        encoder = ChunkEncoder(response_id, prompt_tokens, request.n)
        async for event in gen.handle:
            yield encoder.encode(event)
        result = await gen.handle.result()
        gen.success(result.generated_tokens, result.timings)
        yield DONE

    if body.get("stream"):
        return await request_path.stream(prepare, SHAPE, chunks)
    return await request_path.generate(prepare, SHAPE, answer)
