# GENERATED from openapi/lightllm.yaml (sha256 792186aa75f6e74d) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class HealthMessage(Enum):
    Ok = 'Ok'
    Error = 'Error'


class HealthStatus(BaseModel):
    message: HealthMessage = Field(..., title='HealthMessage')


class ErrorResponse(BaseModel):
    message: str


class TokenLoad(BaseModel):
    current_load: float = Field(
        ..., description='Tokens held by running requests / KV pool size', ge=0.0
    )
    logical_max_load: float = Field(
        ..., description='Same value as dynamic_max_load (as in LightLLM)', ge=0.0
    )
    dynamic_max_load: float = Field(
        ...,
        description='Estimated peak tokens of the running batch / KV pool size',
        ge=0.0,
    )


class MultimodalItem(BaseModel):
    type: str | None = Field(None, examples=['base64'])
    data: str | None = None


class GenerateParameters(BaseModel):
    model_config = ConfigDict(
        extra='forbid',
    )
    do_sample: bool = False
    temperature: float = Field(
        1.0, description='Below 1e-5 decoding is greedy (as in LightLLM)', ge=0.0
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description='-1 considers all tokens', ge=-1)
    presence_penalty: float = Field(0.0, ge=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0)
    repetition_penalty: float = Field(1.0, ge=1.0)
    ignore_eos: bool = False
    max_new_tokens: int = Field(16, ge=1)
    min_new_tokens: int = Field(1, description='Must not exceed max_new_tokens', ge=1)
    stop_sequences: str | list[str] | list[list[int]] | None = Field(
        None,
        description='A stop string, a list of them, or a list of token-id sequences (as LightLLM accepts: str, list[str] or list[list[int]]). A one-id sequence stops on that token; a longer one stops where its decoded text appears. Empty strings and sequences are ignored.',
    )
    best_of: int = Field(1, ge=1, le=8)
    n: int | None = Field(
        None,
        description='Number of sequences; defaults to best_of and must equal it',
        ge=1,
        le=8,
    )
    seed: int | None = Field(None, ge=0)
    return_details: bool = Field(
        False, description='Add per-token details (`tokens`) to the /generate response'
    )


class FinishReason(Enum):
    stop = 'stop'
    length = 'length'


class TokenDetail(BaseModel):
    id: int
    text: str
    logprob: float
    special: bool
    count_output_tokens: int
    prompt_tokens: int


class GenerateResponse(BaseModel):
    generated_text: list[str]
    count_output_tokens: int | list[int]
    finish_reason: FinishReason | list[FinishReason]
    prompt_tokens: int
    tokens: list[TokenDetail] | list[list[TokenDetail]] | None = None


class StreamToken(BaseModel):
    token: TokenDetail
    generated_text: str | None = Field(...)
    finished: bool
    finish_reason: str | None = Field(
        ..., description='null until the last event, then stop or length'
    )
    details: dict[str, Any] | None = Field(...)


class ScoreFinishReason(Enum):
    stop = 'stop'


class ScoreResponse(BaseModel):
    score: float
    prompt_tokens: int
    finish_reason: ScoreFinishReason = Field(..., title='ScoreFinishReason')


class MultimodalParams(BaseModel):
    images: list[MultimodalItem] | None = None
    audios: list[MultimodalItem] | None = None


class GenerateRequest(BaseModel):
    inputs: str = Field(..., examples=['What is AI?'])
    parameters: GenerateParameters | None = None
    multimodal_params: MultimodalParams | None = None


class ScoreRequest(BaseModel):
    chat: str = Field(
        ...,
        description='The conversation, already templated (ending with the reward token if any)',
    )
    parameters: dict[str, Any] | None = Field(
        None,
        description='Accepted for compatibility; scoring ignores sampling parameters',
    )
    multimodal_params: MultimodalParams | None = None
