# GENERATED from openapi/sensenova.yaml (sha256 4c4ec9c8826ce073) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, Field


class CompletionRequest(BaseModel):
    prompt: str = Field(..., description='输入文本 (the prompt)')
    model: str = Field(
        ..., description='模型ID (the model id; any value is served by the loaded model)'
    )
    n: int = Field(
        1,
        description="生成结果数量 (number of choices; they share the prompt's KV cache)",
        ge=1,
        le=4,
    )
    max_new_tokens: int = Field(1024, description='期望模型生成的最大token数', ge=1, le=2048)
    repetition_penalty: float = Field(
        1.05, description='重复惩罚系数 (1 = no penalty)', gt=0.0, le=2.0
    )
    stop: str | None = Field(None, description='停止生成的语句 (a stop string)')
    stream: bool = Field(
        False, description='是否使用流式传输 (data-only SSE ended by `data:[DONE]`)'
    )
    temperature: float = Field(0.8, description='温度采样参数', gt=0.0, le=2.0)
    top_p: float = Field(0.7, description='核采样参数', gt=0.0, lt=1.0)


class FinishReason(Enum):
    stop = 'stop'
    length = 'length'
    sensitive = 'sensitive'
    context = 'context'


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionData(BaseModel):
    id: str
    choices: list[Choice]
    usage: Usage


class CompletionResponse(BaseModel):
    data: CompletionData


class ChunkFinishReason(Enum):
    field_ = ''
    stop = 'stop'
    length = 'length'
    sensitive = 'sensitive'
    context = 'context'


class ChunkChoice(BaseModel):
    index: int
    delta: str
    finish_reason: ChunkFinishReason = Field(
        ...,
        description="Empty until the choice's last event, which carries its FinishReason",
        title='ChunkFinishReason',
    )


class ChunkData(BaseModel):
    id: str
    choices: list[ChunkChoice]
    usage: Usage


class Status(BaseModel):
    code: int
    message: str


class CompletionChunk(BaseModel):
    data: ChunkData
    status: Status


class ErrorDetail(BaseModel):
    code: int
    message: str
    details: list[dict[str, Any]]


class ErrorResponse(BaseModel):
    error: ErrorDetail
