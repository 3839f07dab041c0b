"""Engine results -> SenseNova's JSON: a completion, or its stream of chunks ended by `[DONE]`
(compact JSON, non-ASCII kept)."""

from __future__ import annotations

import json
import uuid

from opentgi.engine.events import GenerationResult, TokenEvent
from opentgi.engine.request import FinishReason
from opentgi.schemas import sensenova as schema

DONE = "[DONE]"
OK_STATUS = schema.Status(code=0, message="ok")


def dumps(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def completion_id() -> str:
    return uuid.uuid4().hex


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
