# GENERATED from openapi/openai-responses.yaml (sha256 f3b8468bc2c33103) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, RootModel


class Type(Enum):
    message = 'message'


class Role(Enum):
    user = 'user'
    assistant = 'assistant'
    system = 'system'
    developer = 'developer'


class Status(Enum):
    in_progress = 'in_progress'
    completed = 'completed'
    incomplete = 'incomplete'


class Type1(Enum):
    input_text = 'input_text'
    output_text = 'output_text'
    refusal = 'refusal'
    input_image = 'input_image'
    input_file = 'input_file'


class InputContent(BaseModel):
    type: Type1
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    detail: str | None = None


class Type2(Enum):
    function_call = 'function_call'


class FunctionCallItem(BaseModel):
    type: Type2
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None


class Type3(Enum):
    function_call_output = 'function_call_output'


class Status2Enum(Enum):
    in_progress = 'in_progress'
    completed = 'completed'
    incomplete = 'incomplete'


class Status2(RootModel[Status2Enum | None]):
    root: Status2Enum | None = None


class FunctionCallOutputItem(BaseModel):
    type: Type3
    call_id: str
    output: str | list[InputContent]
    id: str | None = None
    status: Status2 | None = None


class Type4(Enum):
    reasoning = 'reasoning'


class Status3Enum(Enum):
    in_progress = 'in_progress'
    completed = 'completed'
    incomplete = 'incomplete'


class Status3(RootModel[Status3Enum | None]):
    root: Status3Enum | None = None


class Type5(Enum):
    summary_text = 'summary_text'


class SummaryText(BaseModel):
    type: Type5
    text: str


class Type6(Enum):
    reasoning_text = 'reasoning_text'


class ReasoningText(BaseModel):
    type: Type6
    text: str


class Tool(BaseModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice1(Enum):
    none = 'none'
    auto = 'auto'
    required = 'required'


class Type7(Enum):
    function = 'function'


class ToolChoiceFunction(BaseModel):
    type: Type7
    name: str


class EffortEnum(Enum):
    none = 'none'
    minimal = 'minimal'
    low = 'low'
    medium = 'medium'
    high = 'high'
    xhigh = 'xhigh'


class Effort(RootModel[EffortEnum | None]):
    root: EffortEnum | None = None


class SummaryEnum(Enum):
    auto = 'auto'
    concise = 'concise'
    detailed = 'detailed'


class Summary(RootModel[SummaryEnum | None]):
    root: SummaryEnum | None = None


class ReasoningConfig(BaseModel):
    effort: Effort | None = None
    summary: Summary | None = None


class Type8(Enum):
    text = 'text'
    json_object = 'json_object'
    json_schema = 'json_schema'


class TextFormat(BaseModel):
    type: Type8
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias='schema')
    description: str | None = None
    strict: bool | None = None


class Object(Enum):
    response = 'response'


class Status4(Enum):
    completed = 'completed'
    failed = 'failed'
    in_progress = 'in_progress'
    incomplete = 'incomplete'


class Reason(Enum):
    max_output_tokens = 'max_output_tokens'


class IncompleteDetails(BaseModel):
    reason: Reason | None = None


class ResponseError(BaseModel):
    code: str
    message: str


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(
        ..., description='Prompt tokens served from the prefix cache.', ge=0
    )
    cache_write_tokens: int = Field(
        ...,
        description='Prompt tokens the prefix cache keeps for later requests (the others).',
        ge=0,
    )


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(..., ge=0)


class ResponseUsage(BaseModel):
    input_tokens: int = Field(..., ge=0)
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(..., ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(..., ge=0)


class Type9(Enum):
    message = 'message'


class Role1(Enum):
    assistant = 'assistant'


class Status5(Enum):
    in_progress = 'in_progress'
    completed = 'completed'
    incomplete = 'incomplete'


class Type10(Enum):
    output_text = 'output_text'


class OutputText(BaseModel):
    type: Type10
    text: str
    annotations: list[dict[str, Any]] = Field(..., max_length=0)


class Type11(Enum):
    function_call = 'function_call'


class OutputFunctionCall(BaseModel):
    type: Literal['function_call']
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status5


class Type12(Enum):
    reasoning = 'reasoning'


class OutputReasoning(BaseModel):
    type: Literal['reasoning']
    id: str
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    status: Status5 | None = None


class Object1(Enum):
    response_deleted = 'response.deleted'


class ResponseDeleted(BaseModel):
    id: str
    object: Object1
    deleted: bool


class Type13(Enum):
    response_created = 'response.created'
    response_in_progress = 'response.in_progress'
    response_completed = 'response.completed'
    response_incomplete = 'response.incomplete'
    response_failed = 'response.failed'


class Type14(Enum):
    response_output_item_added = 'response.output_item.added'
    response_output_item_done = 'response.output_item.done'


class Type15(Enum):
    response_content_part_added = 'response.content_part.added'
    response_content_part_done = 'response.content_part.done'
    response_reasoning_part_added = 'response.reasoning_part.added'
    response_reasoning_part_done = 'response.reasoning_part.done'


class ContentPartEvent(BaseModel):
    type: Type15
    sequence_number: int = Field(..., ge=0)
    output_index: int = Field(..., ge=0)
    item_id: str
    content_index: int = Field(..., ge=0)
    part: OutputText | ReasoningText


class Type16(Enum):
    response_output_text_delta = 'response.output_text.delta'
    response_reasoning_text_delta = 'response.reasoning_text.delta'


class TextDeltaEvent(BaseModel):
    type: Type16
    sequence_number: int = Field(..., ge=0)
    output_index: int = Field(..., ge=0)
    item_id: str
    content_index: int = Field(..., ge=0)
    delta: str
    logprobs: list[dict[str, Any]] | None = Field(None, max_length=0)


class Type17(Enum):
    response_output_text_done = 'response.output_text.done'
    response_reasoning_text_done = 'response.reasoning_text.done'


class TextDoneEvent(BaseModel):
    type: Type17
    sequence_number: int = Field(..., ge=0)
    output_index: int = Field(..., ge=0)
    item_id: str
    content_index: int = Field(..., ge=0)
    text: str
    logprobs: list[dict[str, Any]] | None = Field(None, max_length=0)


class Type18(Enum):
    response_function_call_arguments_delta = 'response.function_call_arguments.delta'


class ArgumentsDeltaEvent(BaseModel):
    type: Type18
    sequence_number: int = Field(..., ge=0)
    output_index: int = Field(..., ge=0)
    item_id: str
    delta: str


class Type19(Enum):
    response_function_call_arguments_done = 'response.function_call_arguments.done'


class ArgumentsDoneEvent(BaseModel):
    type: Type19
    sequence_number: int = Field(..., ge=0)
    output_index: int = Field(..., ge=0)
    item_id: str
    name: str | None = None
    arguments: str


class Type20(Enum):
    error = 'error'


class StreamErrorEvent(BaseModel):
    type: Type20
    sequence_number: int = Field(..., ge=0)
    code: str | None = None
    message: str
    param: str | None = None


class Type21(Enum):
    invalid_request_error = 'invalid_request_error'
    authentication_error = 'authentication_error'
    not_found_error = 'not_found_error'
    rate_limit_error = 'rate_limit_error'
    server_error = 'server_error'


class Error(BaseModel):
    message: str
    type: Type21
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: Error


class InputMessage(BaseModel):
    type: Type | None = None
    role: Role
    content: str | list[InputContent]
    id: str | None = None
    status: Status | None = None


class ReasoningItem(BaseModel):
    type: Type4
    id: str | None = None
    summary: list[SummaryText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Status3 | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class OutputMessage(BaseModel):
    type: Literal['message']
    id: str
    role: Role1
    status: Status5
    content: list[OutputText]


class OutputItemEvent(BaseModel):
    type: Type14
    sequence_number: int = Field(..., ge=0)
    output_index: int = Field(..., ge=0)
    item: OutputMessage | OutputFunctionCall | OutputReasoning = Field(
        ..., discriminator='type'
    )


class CreateResponseRequest(BaseModel):
    model: str | None = Field(None, description='Any name; the served model answers.')
    input: (
        str
        | list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
        | None
    ) = Field(None, description='A user message as a string, or input items.')
    instructions: str | None = Field(
        None,
        description='The system (developer) message; not carried over by previous_response_id.',
    )
    tools: list[Tool] | None = None
    tool_choice: ToolChoice1 | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None


class Response(BaseModel):
    id: str = Field(
        ..., examples=['resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b']
    )
    object: Object
    created_at: int
    status: Status4
    model: str
    output: list[
        Annotated[
            OutputMessage | OutputFunctionCall | OutputReasoning,
            Field(discriminator='type'),
        ]
    ]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool
    tool_choice: ToolChoice1 | ToolChoiceFunction
    tools: list[Tool]
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None


class ResponseLifecycleEvent(BaseModel):
    type: Type13
    sequence_number: int = Field(..., ge=0)
    response: Response


class ResponseStreamEvent(
    RootModel[
        ResponseLifecycleEvent
        | OutputItemEvent
        | ContentPartEvent
        | TextDeltaEvent
        | TextDoneEvent
        | ArgumentsDeltaEvent
        | ArgumentsDoneEvent
        | StreamErrorEvent
    ]
):
    root: ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent | StreamErrorEvent
