# GENERATED from openapi/tenants.yaml (sha256 9aacd77b7988cebc) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from pydantic import BaseModel, Field


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(..., examples=['sql'], min_length=1)
    lora_path: str = Field(
        ...,
        description='A local PEFT adapter folder, or a hub id already in the local cache',
        examples=['/adapters/sql-lora'],
        min_length=1,
    )


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(..., examples=['sql'], min_length=1)
    lora_int_id: int | None = Field(
        None, description="Accepted and ignored (vLLM's), adapters are named"
    )


class Rejections(BaseModel):
    tokens_per_minute: int = Field(..., ge=0)
    max_concurrent_requests: int = Field(..., ge=0)


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class TenantUsage(BaseModel):
    name: str = Field(..., examples=['alpha'])
    requests: int = Field(..., description='Requests admitted (past the quotas)', ge=0)
    prompt_tokens: int = Field(
        ..., description='Prompt tokens of ended requests, cached ones included', ge=0
    )
    generated_tokens: int = Field(
        ...,
        description='Tokens generated for ended requests (a cancelled one counts what it got)',
        ge=0,
    )
    total_tokens: int = Field(..., ge=0)
    rejected: Rejections
    in_flight: int = Field(..., description='Requests being served now', ge=0)
    tokens_last_minute: int = Field(
        ...,
        description='Tokens counted within the last `window_seconds` (what `tokens_per_minute` limits)',
        ge=0,
    )


class UsageReport(BaseModel):
    window_seconds: int = Field(
        ...,
        description='The rolling window of `tokens_last_minute` and of `tokens_per_minute` quotas',
        examples=[60],
    )
    tenants: list[TenantUsage]
