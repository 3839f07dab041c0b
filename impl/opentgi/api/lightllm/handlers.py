"""LightLLM's HTTP API (openapi/lightllm.yaml): thin handlers, one per operationId.

Each takes the body in LightLLM's model, makes one engine request (`params.py`) through the one
request path (`opentgi.api.generation`), and answers in LightLLM's shape (`shapes.py`); every error
is answered by `errors.lightllm_error`.
"""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from opentgi.api import generation as request_path
from opentgi.api import runtime
from opentgi.api.generation import ErrorPolicy, Generation, Prepare
from opentgi.api.lightllm import params, shapes
from opentgi.api.lightllm.errors import lightllm_error
from opentgi.engine.errors import OpenTGIError
from opentgi.engine.events import GenerationResult
from opentgi.schemas import lightllm as schema

ERROR_POLICY = ErrorPolicy(error=lightllm_error)


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
    return JSONResponse(shapes.compute_token_load(engine.stats(), engine.info.max_batch_total_tokens))


def _prepare_generate(body: dict, *, stream: bool) -> Prepare:
    async def prepare():
        engine = runtime.engine()
        request, parameters = params.parse_generate(body)
        params.check_text_only(request.multimodal_params, engine.info.model_id)
        if stream:
            params.check_stream(parameters)
        prompt_token_ids = await engine.encode(request.inputs, max_tokens=engine.info.max_input_tokens)
        params.check_lengths(len(prompt_token_ids), parameters.max_new_tokens, engine.info.max_input_tokens,
                             engine.info.max_total_tokens)
        generation = params.generation_request(prompt_token_ids, parameters, params.EngineVocabulary(engine),
                                               stream=stream)
        return [generation], (parameters, len(prompt_token_ids))

    return prepare


async def generate(body: dict):
    def answer(gen: Generation, results: list[GenerationResult]) -> Response:
        parameters, _ = gen.context
        return shapes.json_answer(shapes.generate_response(results[0], return_details=parameters.return_details))

    return await request_path.generate(_prepare_generate(body, stream=False), ERROR_POLICY, answer)


async def _stream_events(gen: Generation):
    _, prompt_tokens = gen.context
    async for event in gen.handle:
        yield shapes.stream_event(event, prompt_tokens)
    result = await gen.handle.result()
    gen.success(result.generated_tokens, result.timings)


async def generate_stream(body: dict):
    return await request_path.stream(_prepare_generate(body, stream=True), ERROR_POLICY, _stream_events)


async def get_score(body: dict):
    async def prepare():
        engine = runtime.engine()
        request = schema.ScoreRequest.model_validate(body)
        params.check_text_only(request.multimodal_params, engine.info.model_id)
        params.check_reward_model(engine.info)
        prompt_token_ids = await engine.encode(request.chat, max_tokens=engine.info.max_total_tokens)
        return [params.score_request(prompt_token_ids)], None

    def answer(gen: Generation, results: list[GenerationResult]) -> Response:
        return shapes.json_answer(shapes.score_response(results[0]))

    return await request_path.generate(prepare, ERROR_POLICY, answer)
