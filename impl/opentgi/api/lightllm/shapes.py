"""Engine results -> LightLLM's JSON, serialized the way LightLLM's server writes it:
`json.dumps(..., ensure_ascii=False)` for /generate, /generate_stream and /get_score, starlette's
compact JSONResponse for /health, /token_load and errors."""

from __future__ import annotations

import json

from starlette.responses import Response

from opentgi.engine.errors import GenerationError
from opentgi.engine.events import GenerationResult, SequenceResult, TokenEvent
from opentgi.engine.request import FinishReason
from opentgi.schemas import lightllm as schema


def lightllm_finish_reason(reason: FinishReason) -> str:
    """LightLLM knows two reasons: "length" (out of tokens or context) and "stop" (anything else)."""
    return "length" if reason in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"


def dumps(payload: dict) -> str:
    """LightLLM's own serialization of generation answers (spaces after separators)."""
    return json.dumps(payload, ensure_ascii=False)


def json_answer(payload: dict) -> Response:
    return Response(content=dumps(payload).encode("utf-8"), media_type="application/json")


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
