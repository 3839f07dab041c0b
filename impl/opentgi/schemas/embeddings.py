# GENERATED from openapi/embeddings.yaml (sha256 f72c3ba61e593f35) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field, RootModel


class EmbeddingInputString(RootModel[str]):
    root: str = Field(
        ...,
        description='Text to embed: a string, an array of strings, an array of token ids, or an array of arrays of token ids. No input may be empty.',
        min_length=1,
        title='EmbeddingInputString',
    )


class EmbeddingInputString1(RootModel[str]):
    root: str = Field(..., min_length=1)


class EmbeddingInputStrings(RootModel[list[EmbeddingInputString1]]):
    root: list[EmbeddingInputString1] = Field(
        ...,
        description='Text to embed: a string, an array of strings, an array of token ids, or an array of arrays of token ids. No input may be empty.',
        min_length=1,
        title='EmbeddingInputStrings',
    )


class EmbeddingInputToken(RootModel[int]):
    root: int = Field(..., ge=0)


class EmbeddingInputTokens(RootModel[list[EmbeddingInputToken]]):
    root: list[EmbeddingInputToken] = Field(
        ...,
        description='Text to embed: a string, an array of strings, an array of token ids, or an array of arrays of token ids. No input may be empty.',
        min_length=1,
        title='EmbeddingInputTokens',
    )


class EmbeddingInputTokenListItem(RootModel[int]):
    root: int = Field(..., ge=0)


class EmbeddingInputTokenList(RootModel[list[EmbeddingInputTokenListItem]]):
    root: list[EmbeddingInputTokenListItem] = Field(..., min_length=1)


class EmbeddingInputTokenLists(RootModel[list[EmbeddingInputTokenList]]):
    root: list[EmbeddingInputTokenList] = Field(
        ...,
        description='Text to embed: a string, an array of strings, an array of token ids, or an array of arrays of token ids. No input may be empty.',
        min_length=1,
        title='EmbeddingInputTokenLists',
    )


class EncodingFormat(Enum):
    float = 'float'
    base64 = 'base64'


class CreateEmbeddingRequest(BaseModel):
    input: (
        EmbeddingInputString
        | EmbeddingInputStrings
        | EmbeddingInputTokens
        | EmbeddingInputTokenLists
    ) = Field(..., description='Text to embed: a string, an array of strings, an array of token ids, or an array of arrays of token ids. No input may be empty.')
    model: str = Field(..., description='Any name: the served model answers.')
    encoding_format: EncodingFormat = Field(
        'float',
        description='`base64`: each vector as the base64 of its little-endian float32 bytes.',
    )
    dimensions: int | None = Field(
        None,
        description="Keep the first `dimensions` components, then normalize to unit length. At most the model's size.",
        ge=1,
    )
    user: str | None = Field(None, description='Accepted and ignored.')


class Object(Enum):
    list = 'list'


class Object1(Enum):
    embedding = 'embedding'


class Embedding(BaseModel):
    index: int = Field(..., ge=0)
    embedding: list[float] | str
    object: Object1


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(..., ge=0)
    total_tokens: int = Field(..., ge=0)


class RerankRequest(BaseModel):
    model: str | None = Field(None, description='Any name: the served model answers.')
    query: str
    documents: list[str] = Field(..., min_length=1)
    top_n: int | None = Field(
        None,
        description='How many of the best documents to answer (all of them by default).',
        ge=1,
    )
    return_documents: bool = Field(
        True, description="Whether each result carries its document's text."
    )


class RerankUsage(BaseModel):
    total_tokens: int = Field(..., ge=0)


class RerankDocument(BaseModel):
    text: str


class Type(Enum):
    invalid_request_error = 'invalid_request_error'
    authentication_error = 'authentication_error'
    not_found_error = 'not_found_error'
    rate_limit_error = 'rate_limit_error'
    server_error = 'server_error'


class Error(BaseModel):
    message: str
    type: Type
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: Error


class CreateEmbeddingResponse(BaseModel):
    data: list[Embedding]
    model: str
    object: Object
    usage: EmbeddingUsage


class RerankResult(BaseModel):
    index: int = Field(..., ge=0)
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
