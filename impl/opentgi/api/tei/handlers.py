"""openapi/tei.yaml: TEI's `POST /embed`, `/embed_all`, `/similarity`, `/rerank` and `/predict`, in
TEI's order of checks (empty input, then the model's kind, then the batch size) and its defaults
(`normalize` true, `truncate` false, scores through a sigmoid or softmax unless `raw_scores`)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from opentgi.api.embeddings import common
from opentgi.api.embeddings.common import EmptyInputError
from opentgi.schemas import tei as schema


def _left(direction) -> bool:
    return direction is not None and str(getattr(direction, "value", direction)).lower() == "left"


def _texts(request) -> list:
    """`inputs` as a list: a text, one token list, or a batch of texts and token lists; refused
    where empty or past the client batch size."""
    data = request.model_dump(mode="json", include={"inputs"})["inputs"]
    texts = [data] if isinstance(data, str) or (data and isinstance(data[0], int)) else list(data)
    if not texts:
        raise EmptyInputError("`inputs` cannot be empty")
    common.check_batch_size(len(texts))
    return texts


async def embed(body: dict) -> JSONResponse:
    request = schema.EmbedRequest.model_validate(body)
    texts = _texts(request)
    engine = common.pooling_engine("embedding")
    common.check_dimensions(request.dimensions, engine)
    inputs = await engine.text_inputs(texts, truncate=bool(request.truncate),
                                      left=_left(request.truncation_direction))
    vectors = await engine.embed(inputs, normalize=request.normalize, dimensions=request.dimensions)
    return JSONResponse(schema.EmbedResponse(vectors).model_dump(mode="json"))


async def embed_all(body: dict) -> JSONResponse:
    request = schema.EmbedAllRequest.model_validate(body)
    texts = _texts(request)
    engine = common.pooling_engine("embedding")
    inputs = await engine.text_inputs(texts, truncate=bool(request.truncate),
                                      left=_left(request.truncation_direction))
    tokens = await engine.embed_all(inputs)
    return JSONResponse(schema.EmbedAllResponse(tokens).model_dump(mode="json"))


async def similarity(body: dict) -> JSONResponse:
    """TEI's: the source sentence and the others embedded in one batch, normalized; each other's
    cosine with the source (their dot product)."""
    request = schema.SimilarityRequest.model_validate(body)
    if not request.inputs.sentences:
        raise EmptyInputError("`inputs.sentences` cannot be empty")
    engine = common.pooling_engine("embedding")
    texts = [request.inputs.source_sentence, *request.inputs.sentences]
    common.check_batch_size(len(texts))
    parameters = request.parameters or schema.SimilarityParameters()
    inputs = await engine.text_inputs(texts, truncate=bool(parameters.truncate),
                                      left=_left(parameters.truncation_direction))
    source, *others = await engine.embed(inputs, normalize=True)
    cosines = [sum(a * b for a, b in zip(source, other, strict=True)) for other in others]
    return JSONResponse(schema.SimilarityResponse(cosines).model_dump(mode="json"))


async def rerank(body: dict) -> JSONResponse:
    request = schema.RerankRequest.model_validate(body)
    if not request.texts:
        raise EmptyInputError("`texts` cannot be empty")
    engine = common.pooling_engine("rerank")
    common.check_batch_size(len(request.texts))
    inputs = await engine.pair_inputs([(request.query, t) for t in request.texts], truncate=bool(request.truncate),
                                      left=_left(request.truncation_direction))
    logits = await engine.classify(inputs)
    ranks = [schema.Rank(index=i, score=common.scores(row, request.raw_scores)[0],
                         text=request.texts[i] if request.return_text else None) for i, row in enumerate(logits)]
    ranks.sort(key=lambda r: -r.score)
    return JSONResponse(schema.RerankResponse(ranks).model_dump(mode="json"))


async def predict(body: dict) -> JSONResponse:
    request = schema.PredictRequest.model_validate(body)
    data = request.model_dump(mode="json", include={"inputs"})["inputs"]
    single = isinstance(data, str) or (len(data) == 2 and all(isinstance(t, str) for t in data))
    items = [tuple([data] if isinstance(data, str) else data)] if single else [tuple(item) for item in data]
    if not items:
        raise EmptyInputError("`inputs` cannot be empty")
    engine = common.pooling_engine("classification")
    common.check_batch_size(len(items))
    inputs = await engine.pair_inputs(items, truncate=bool(request.truncate), left=_left(request.truncation_direction))
    logits = await engine.classify(inputs)
    labels = engine.id2label
    answers = []
    for row in logits:
        predictions = [schema.Prediction(label=labels.get(i, f"LABEL_{i}"), score=score)
                       for i, score in enumerate(common.scores(row, request.raw_scores))]
        predictions.sort(key=lambda p: -p.score)
        answers.append(predictions)
    body_out = answers[0] if single else answers
    return JSONResponse(schema.PredictResponse(body_out).model_dump(mode="json"))
