"""TGI 2.1's HTTP API (openapi/tgi.json): one thin handler per operationId.

Body in (already checked against the document by Connexion) -> TGI's parameter semantics
(`tgi_params`) -> one engine request -> TGI's JSON (`tgi_responses`) or SSE (`sse`). Errors map
once, in `errors.tgi_error`. As in TGI, a streaming request that fails TGI's validation, or that
the engine refuses, still answers 200 and carries the error as the stream's only event.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pydantic
from starlette.responses import JSONResponse, Response

from opentgi import __version__
from opentgi.api import generation, runtime
from opentgi.api.adapters import models_list
from opentgi.api.errors import DeserializationError, IncompleteGenerationError, tgi_error
from opentgi.api.images import ImageLimits, load_images, markdown_images
from opentgi.api.tgi import shapes as encode
from opentgi.api.tgi.params import Limits, build_request, check_integer_widths, check_parameters
from opentgi.api.tgi.tokens import detokenize, get_chat_tokenize  # noqa: F401 - operationIds of tgi.json
from opentgi.engine.errors import OpenTGIError, ValidationError
from opentgi.engine.events import GenerationResult
from opentgi.schemas.tgi import GenerateParameters

log = logging.getLogger(__name__)

ROUTER_NAME = "opentgi"
HEALTH_RECENT_S = 10.0  # a generation that succeeded this recently vouches for the engine
# /tokenize takes texts of up to this many characters per token of the KV pool (no request could
# use more tokens than the pool holds), so a huge text costs a 422, not seconds of tokenizing.
TOKENIZE_MAX_CHARS_PER_TOKEN = 16


# --- request preparation -------------------------------------------------------------------------

# TGI answers a refused stream with a 200 whose only event is the error.
ERROR_POLICY = generation.ErrorPolicy(error=tgi_error, refuse_in_stream=True)


@dataclass
class Prepared:
    inputs: str
    input_length: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool


def _parameters(body: dict) -> GenerateParameters | None:
    """The body's `parameters` in TGI's types (raises DeserializationError where serde would fail)."""
    raw = body.get("parameters")
    if raw is None:
        return None
    check_integer_widths(raw)
    try:
        return GenerateParameters.model_validate(raw)
    except pydantic.ValidationError as exc:  # the document and the generated model disagree
        first = exc.errors()[0]
        where = ".".join(str(p) for p in ("parameters", *first["loc"]))
        raise DeserializationError(f"{where}: {first['msg']}") from exc


def _prepare(body: dict, parameters: GenerateParameters | None, *, stream: bool,
             default_return_full_text: bool = False) -> generation.Prepare:
    async def prepare():
        state = runtime.state()
        engine = state.engine
        limits = Limits.from_settings(state.settings, engine.info)
        inputs = body["inputs"]
        params = check_parameters(inputs, parameters, limits, stream=stream)
        if parameters is None or parameters.return_full_text is None:
            params.return_full_text = default_return_full_text
        # with `truncate`, TGI keeps the prompt's last tokens: any length is fine
        max_tokens = None if params.truncate else limits.max_input_tokens
        # a model that takes images reads TGI's markdown images, `![](url)`, as TGI does
        marker = engine.info.image_marker if getattr(engine.info, "image_input", False) else None
        text, urls = markdown_images(inputs, marker) if marker else (inputs, [])
        images = await load_images(urls, ImageLimits.of(state.settings)) if urls else []
        if images:
            prompt_token_ids, image_inputs = await engine.encode_images(text, images, max_tokens=max_tokens)
        else:
            prompt_token_ids, image_inputs = await engine.encode(inputs, max_tokens=max_tokens), []
        if parameters is not None and parameters.grammar is not None:  # the schema checks: off the loop
            request = await asyncio.to_thread(build_request, params, prompt_token_ids, limits, parameters)
        else:
            request = build_request(params, prompt_token_ids, limits, parameters)
        if image_inputs and request.num_prompt_tokens < len(prompt_token_ids):
            raise ValidationError("`truncate` would cut into a prompt with images: raise it or leave it out")
        request.images = image_inputs
        return [request], Prepared(inputs=inputs, input_length=request.num_prompt_tokens, details=params.details,
                                   decoder_input_details=params.decoder_input_details,
                                   return_full_text=params.return_full_text)

    return prepare


def _compute_type() -> str:
    device = runtime.engine().info.model_device_type
    return "gpu+optimized" if device == "cuda" else f"{device}+optimized"


# --- generation -------------------------------------------------------------------------------------


def _generate_headers(prepared: Prepared, timings: dict[str, float], generated_tokens: int) -> dict[str, str]:
    """TGI's timing headers: milliseconds as integers, x-compute-time in seconds."""
    def ms(seconds: float) -> str:
        return str(int(seconds * 1000))

    per_token = timings["inference_s"] / generated_tokens if generated_tokens else 0.0
    return {
        "x-compute-type": _compute_type(),
        "x-compute-time": repr(timings["total_s"]),
        "x-compute-characters": str(len(prepared.inputs)),
        "x-total-time": ms(timings["total_s"]),
        "x-validation-time": ms(timings["validation_s"]),
        "x-queue-time": ms(timings["queue_s"]),
        "x-inference-time": ms(timings["inference_s"]),
        "x-time-per-token": ms(per_token),
        "x-prompt-tokens": str(prepared.input_length),
        "x-generated-tokens": str(generated_tokens),
    }


def _winner_tokens(results: list[GenerationResult]) -> int:
    """TGI counts the tokens of the answer it returns (best_of's best sequence)."""
    result = results[0]
    return result.sequences[encode.best_sequence_index(result)].generated_tokens


async def _json_answer(body: dict, *, default_return_full_text: bool = False, as_list: bool = False) -> Response:
    try:
        parameters = _parameters(body)
    except OpenTGIError as exc:  # refused before TGI's handler: not counted
        return tgi_error(exc).response()

    def answer(gen: generation.Generation, results: list[GenerationResult]) -> Response:
        prepared, result = gen.context, results[0]
        payload = encode.generate_response(
            result, details=prepared.details, decoder_input_details=prepared.decoder_input_details,
            prompt_prefix=prepared.inputs if prepared.return_full_text else None)
        headers = _generate_headers(prepared, gen.durations, _winner_tokens(results))
        return JSONResponse([payload] if as_list else payload, headers=headers)

    prepare = _prepare(body, parameters, stream=False, default_return_full_text=default_return_full_text)
    return await generation.generate(prepare, ERROR_POLICY, answer, generated_tokens=_winner_tokens)


async def generate(body: dict) -> Response:
    return await _json_answer(body)


async def _stream_events(gen: generation.Generation) -> AsyncIterator[dict]:
    prepared = gen.context
    index = 0
    async for event in gen.handle:
        index += 1
        if event.finish_reason is None:
            yield encode.stream_response(index, event)
            continue
        result = await gen.handle.result()
        sequence = result.sequences[0]
        prefix = prepared.inputs if prepared.return_full_text else ""
        details = encode.stream_details(sequence) if prepared.details else None
        gen.success(sequence.generated_tokens, result.timings)
        yield encode.stream_response(index, event, generated_text=prefix + sequence.text, details=details)
        return
    raise IncompleteGenerationError()


async def _stream(body: dict, *, default_return_full_text: bool = False) -> Response:
    try:
        parameters = _parameters(body)
    except OpenTGIError as exc:  # refused before the stream opens, as axum refuses it: not counted
        return tgi_error(exc).response()
    headers = {"x-compute-type": _compute_type(), "x-compute-characters": str(len(body["inputs"]))}
    prepare = _prepare(body, parameters, stream=True, default_return_full_text=default_return_full_text)
    return await generation.stream(prepare, ERROR_POLICY, _stream_events, headers=headers)


async def generate_stream(body: dict) -> Response:
    return await _stream(body)


async def compat_generate(body: dict) -> Response:
    """POST /: `stream` picks SSE or a one-element array; return_full_text defaults by pipeline tag."""
    full_text = runtime.engine().info.pipeline_tag == "text-generation"
    if body.get("stream"):
        return await _stream(body, default_return_full_text=full_text)
    return await _json_answer(body, default_return_full_text=full_text, as_list=True)


# --- service routes -----------------------------------------------------------------------------------


async def health() -> Response:
    state = runtime.state()
    engine = state.engine
    ok = engine.healthy() and not state.drain.draining  # a server shutting down takes no more traffic
    recent = state.last_success_at is not None and time.monotonic() - state.last_success_at < HEALTH_RECENT_S
    if ok and not recent:
        ok = await engine.probe()
        if ok:
            state.record_success()
    if not ok:
        return JSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, status_code=503)
    return Response(status_code=200)


async def get_model_info() -> Response:
    state = runtime.state()
    info, settings = state.engine.info, state.settings
    return JSONResponse({
        "model_id": info.model_id,
        "model_sha": info.model_sha,
        "model_dtype": info.model_dtype,
        "model_device_type": info.model_device_type,
        "model_pipeline_tag": info.pipeline_tag,
        "max_concurrent_requests": settings.max_concurrent_requests,
        "max_best_of": settings.max_best_of,
        "max_stop_sequences": settings.max_stop_sequences,
        "max_input_tokens": info.max_input_tokens,
        "max_total_tokens": info.max_total_tokens,
        "waiting_served_ratio": settings.waiting_served_ratio,
        "max_batch_total_tokens": info.max_batch_total_tokens,
        "max_waiting_tokens": settings.max_waiting_tokens,
        "max_batch_size": settings.max_batch_size,
        "validation_workers": validation_workers(),
        "max_client_batch_size": settings.max_client_batch_size,
        "router": ROUTER_NAME,
        "version": __version__,
        "sha": source_sha(),
        "docker_label": None,
        "adapters": list(info.adapters),
        "deterministic": bool(getattr(info, "deterministic", True)),
        "kernels": getattr(info, "kernels", "torch"),
        "kv_cache_dtype": getattr(info, "kv_cache_dtype", None),
        "model_architecture": info.architecture,
        "supported_architectures": list(info.supported_architectures),
        "model_kind": getattr(info, "model_kind", "generation"),
    })


async def openai_get_model_info() -> Response:
    """GET /v1/models: the base model and its LoRA adapters."""
    return JSONResponse(models_list(runtime.engine().info))


def validation_workers() -> int:
    """Tokenization runs in asyncio's default thread pool: its size is the number of workers."""
    return min(32, (os.cpu_count() or 1) + 4)


@functools.lru_cache(maxsize=1)
def source_sha() -> str | None:
    """The git commit of the source tree this package runs from, when it runs from a checkout."""
    root = Path(__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if len(sha) == 40 else None


async def tokenize(body: dict) -> Response:
    try:
        parameters = _parameters(body)
    except OpenTGIError as exc:
        return tgi_error(exc).response()
    inputs = body["inputs"]
    engine = runtime.engine()
    if len(inputs) > engine.info.max_batch_total_tokens * TOKENIZE_MAX_CHARS_PER_TOKEN:
        return tgi_error(ValidationError(
            f"`inputs` is too long to tokenize: {len(inputs)} characters, at most "
            f"{engine.info.max_batch_total_tokens * TOKENIZE_MAX_CHARS_PER_TOKEN}")).response()
    tokenized = await engine.tokenize(inputs)
    if tokenized is None:
        return JSONResponse({"error": "No fast tokenizer or tokenizer.json for this model",
                             "error_type": "no fast tokenizer"}, status_code=404)
    ids, offsets = tokenized.ids, tokenized.offsets
    truncate = parameters.truncate if parameters is not None else None
    if truncate is not None and truncate < len(ids):
        ids, offsets = ids[len(ids) - truncate:], offsets[len(offsets) - truncate:]
    return JSONResponse(encode.tokenize_response(inputs, ids, offsets))


async def metrics() -> Response:
    content, content_type = runtime.metrics().render()
    return Response(content, headers={"content-type": content_type})


# --- the OpenAI routes live in opentgi.api.openai.handlers ------------------------------------------------------


async def chat_completions(body: dict) -> Response:
    from opentgi.api.openai import handlers as openai
    return await openai.chat_completions(body)


async def completions(body: dict) -> Response:
    from opentgi.api.openai import handlers as openai
    return await openai.completions(body)
