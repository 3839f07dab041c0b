"""openapi/embeddings.yaml: OpenAI's `POST /v1/embeddings` and the Jina/Cohere `POST /v1/rerank`.
Errors in OpenAI's shape (api/responses/errors.py: 400 `invalid_request_error`)."""

from __future__ import annotations

import uuid

from starlette.responses import JSONResponse

from opentgi.api.embeddings import common
from opentgi.engine.errors import InputTooLongError
from opentgi.schemas import embeddings as schema


async def create_embedding(body: dict) -> JSONResponse:
    request = schema.CreateEmbeddingRequest.model_validate(body)
    engine = common.pooling_engine("embedding")
    data = request.model_dump(mode="json", include={"input"})["input"]
    # a string, a token list, or a list of either: one list of inputs
    texts = [data] if isinstance(data, str) or (data and isinstance(data[0], int)) else list(data)
    common.check_batch_size(len(texts))
    common.check_dimensions(request.dimensions, engine)
    try:
        inputs = await engine.text_inputs(texts, truncate=False)
    except InputTooLongError as exc:
        raise InputTooLongError(f"This model's maximum context length is {exc.limit} tokens, however you "
                                f"requested {exc.input_tokens} tokens in one input. Please reduce your input.",
                                input_tokens=exc.input_tokens, max_new_tokens=None, limit=exc.limit) from None
    normalize = engine.normalizes or request.dimensions is not None
    vectors = await engine.embed(inputs, normalize=normalize, dimensions=request.dimensions)
    as_base64 = request.encoding_format == schema.EncodingFormat.base64
    tokens = sum(len(item.ids) for item in inputs)
    answer = schema.CreateEmbeddingResponse(
        object=schema.Object.list, model=engine.info.model_id,
        data=[schema.Embedding(index=i, object=schema.Object1.embedding,
                               embedding=common.base64_floats(v) if as_base64 else v)
              for i, v in enumerate(vectors)],
        usage=schema.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(answer.model_dump(mode="json"))


async def rerank(body: dict) -> JSONResponse:
    request = schema.RerankRequest.model_validate(body)
    engine = common.pooling_engine("rerank")
    common.check_batch_size(len(request.documents))
    inputs = await engine.pair_inputs([(request.query, d) for d in request.documents], truncate=True)
    logits = await engine.classify(inputs)
    ranked = sorted(((common.sigmoid(row[0]), i) for i, row in enumerate(logits)), key=lambda s: -s[0])
    ranked = ranked[:request.top_n] if request.top_n is not None else ranked
    answer = schema.RerankResponse(
        id=f"rerank-{uuid.uuid4().hex}", model=engine.info.model_id,
        usage=schema.RerankUsage(total_tokens=sum(len(item.ids) for item in inputs)),
        results=[schema.RerankResult(index=i, relevance_score=score,
                                     document=schema.RerankDocument(text=request.documents[i])
                                     if request.return_documents else None)
                 for score, i in ranked])
    return JSONResponse(answer.model_dump(mode="json", exclude_none=True))
