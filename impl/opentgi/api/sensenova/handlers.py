"""SenseNova's text completion API (openapi/sensenova.yaml): `POST /v1/llm/completions`.

The handler takes the body in SenseNova's model, makes one engine request (`params.py`) through
the one request path (`opentgi.api.generation`), and answers in SenseNova's shape (`shapes.py`);
every error is answered by `errors.sensenova_error`.
"""

from __future__ import annotations

from starlette.responses import Response

from opentgi.api import generation as request_path
from opentgi.api import runtime
from opentgi.api.adapters import adapter_named_by_model
from opentgi.api.generation import ErrorPolicy, Generation
from opentgi.api.sensenova import params, shapes
from opentgi.api.sensenova.errors import sensenova_error
from opentgi.engine.events import GenerationResult
from opentgi.schemas import sensenova as schema

ERROR_POLICY = ErrorPolicy(error=sensenova_error)


async def completions(body: dict):
    request = None

    async def prepare():
        nonlocal request
        engine = runtime.engine()
        request = schema.CompletionRequest.model_validate(body)
        prompt_token_ids = await engine.encode(request.prompt, max_tokens=engine.info.max_total_tokens)
        params.check_context(request, len(prompt_token_ids), engine.info.max_total_tokens)
        generation = params.generation_request(request, prompt_token_ids, runtime.settings().sensitive_words)
        generation.adapter_id = adapter_named_by_model(engine.info, request.model)  # else the base model
        return [generation], (shapes.completion_id(), len(prompt_token_ids))

    def answer(gen: Generation, results: list[GenerationResult]) -> Response:
        response_id, _ = gen.context
        return Response(shapes.dumps(shapes.completion_response(results[0], response_id)),
                        media_type="application/json")

    async def chunks(gen: Generation):
        response_id, prompt_tokens = gen.context
        encoder = shapes.ChunkEncoder(response_id, prompt_tokens, request.n)
        async for event in gen.handle:
            yield encoder.encode(event)
        result = await gen.handle.result()
        gen.success(result.generated_tokens, result.timings)
        yield shapes.DONE

    if body.get("stream"):
        return await request_path.stream(prepare, ERROR_POLICY, chunks)
    return await request_path.generate(prepare, ERROR_POLICY, answer)
