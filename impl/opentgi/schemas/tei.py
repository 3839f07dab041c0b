# GENERATED from openapi/tei.yaml (sha256 b430ecddbe2742da) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field, RootModel


class EmbedResponse(RootModel[list[list[float]]]):
    root: list[list[float]]


class EmbedAllResponse(RootModel[list[list[list[float]]]]):
    root: list[list[list[float]]] = Field(
        ...,
        description="Each input's token vectors (its special tokens' too), not pooled nor normalized.",
    )


class SimilarityInput(BaseModel):
    source_sentence: str = Field(
        ..., description='The text the others are compared with.'
    )
    sentences: list[str] = Field(
        ..., description='The texts compared with `source_sentence`.'
    )


class SimilarityResponse(RootModel[list[float]]):
    root: list[float] = Field(
        ...,
        description='The cosine similarity of `source_sentence` with each of `sentences`, in their order.',
    )


class InputId(RootModel[int]):
    root: int = Field(..., ge=0)


class Rank(BaseModel):
    index: int = Field(..., ge=0)
    score: float
    text: str | None = None


class RerankResponse(RootModel[list[Rank]]):
    root: list[Rank]


class PredictPair(RootModel[list[str]]):
    root: list[str] = Field(
        ...,
        description='A single string, a pair of strings, or a batch of single strings and pairs.',
        max_length=2,
        min_length=2,
        title='PredictPair',
    )


class PredictBatchItem(RootModel[list[str]]):
    root: list[str] = Field(..., max_length=2, min_length=1)


class Prediction(BaseModel):
    label: str
    score: float


class TruncationDirection(Enum):
    Left = 'Left'
    Right = 'Right'
    left = 'left'
    right = 'right'


class ErrorType(Enum):
    Unhealthy = 'Unhealthy'
    Backend = 'Backend'
    Overloaded = 'Overloaded'
    Validation = 'Validation'
    Tokenizer = 'Tokenizer'
    Empty = 'Empty'


class ErrorResponse(BaseModel):
    error: str
    error_type: ErrorType


class SimilarityParameters(BaseModel):
    truncate: bool | None = None
    truncation_direction: TruncationDirection | None = 'Right'


class RerankRequest(BaseModel):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: TruncationDirection | None = 'Right'


class PredictRequest(BaseModel):
    inputs: PredictPair | str | list[PredictBatchItem] = Field(
        ...,
        description='A single string, a pair of strings, or a batch of single strings and pairs.',
    )
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: TruncationDirection | None = 'Right'


class PredictResponse(RootModel[list[Prediction] | list[list[Prediction]]]):
    root: list[Prediction] | list[list[Prediction]]


class EmbedRequest(BaseModel):
    inputs: str | list[InputId] | list[str | list[InputId]] = Field(
        ..., description='One input (a text or token ids) or a batch of them.'
    )
    normalize: bool = True
    truncate: bool | None = Field(
        None,
        description="Cut an input past the model's maximum to it (refused without).",
    )
    truncation_direction: TruncationDirection | None = 'Right'
    dimensions: int | None = Field(
        None,
        description='Keep the first `dimensions` components (then normalize, with `normalize`).',
        ge=1,
    )


class EmbedAllRequest(BaseModel):
    inputs: str | list[InputId] | list[str | list[InputId]] = Field(
        ..., description='One input (a text or token ids) or a batch of them.'
    )
    truncate: bool | None = Field(
        None,
        description="Cut an input past the model's maximum to it (refused without).",
    )
    truncation_direction: TruncationDirection | None = 'Right'


class SimilarityRequest(BaseModel):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None
