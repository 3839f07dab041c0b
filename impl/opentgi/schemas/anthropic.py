# GENERATED from openapi/anthropic.yaml (sha256 64054ba725e60fb6) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel


class EffortEnum(Enum):
    low = 'low'
    medium = 'medium'
    high = 'high'
    xhigh = 'xhigh'
    max = 'max'


class Effort(RootModel[EffortEnum | None]):
    root: EffortEnum | None = Field(
        None,
        description='How much the model may think (a thinking budget; see docs/differences-from-tgi.md).',
    )


class Type(Enum):
    json_schema = 'json_schema'


class JsonOutputFormat(BaseModel):
    type: Type
    schema_: dict[str, Any] = Field(..., alias='schema')


class Metadata(BaseModel):
    user_id: str | None = Field(None, max_length=256)


class Role(Enum):
    user = 'user'
    assistant = 'assistant'


class Type1(Enum):
    text = 'text'


class TextBlockParam(BaseModel):
    type: Literal['text']
    text: str


class Type2(Enum):
    image = 'image'


class ImageBlockParam(BaseModel):
    type: Literal['image']
    source: dict[str, Any]


class Type3(Enum):
    document = 'document'


class DocumentBlockParam(BaseModel):
    type: Literal['document']
    source: dict[str, Any]


class Type4(Enum):
    tool_use = 'tool_use'


class ToolUseBlockParam(BaseModel):
    type: Literal['tool_use']
    id: str
    name: str
    input: dict[str, Any]


class Type5(Enum):
    tool_result = 'tool_result'


class Type6(Enum):
    thinking = 'thinking'


class ThinkingBlockParam(BaseModel):
    type: Literal['thinking']
    thinking: str
    signature: str | None = None


class Type7(Enum):
    redacted_thinking = 'redacted_thinking'


class RedactedThinkingBlockParam(BaseModel):
    type: Literal['redacted_thinking']
    data: str


class Type8(Enum):
    custom = 'custom'


class Type9(Enum):
    object = 'object'


class InputSchema(BaseModel):
    model_config = ConfigDict(
        extra='allow',
    )
    type: Type9


class Tool(BaseModel):
    type: Type8 | None = None
    name: str = Field(
        ..., max_length=128, min_length=1, pattern='^[a-zA-Z0-9_-]{1,128}$'
    )
    description: str | None = None
    input_schema: InputSchema = Field(
        ..., description="The JSON schema of the tool's `input`."
    )


class Type10(Enum):
    auto = 'auto'


class ToolChoiceAuto(BaseModel):
    type: Literal['auto']
    disable_parallel_tool_use: bool | None = None


class Type11(Enum):
    any = 'any'


class ToolChoiceAny(BaseModel):
    type: Literal['any']
    disable_parallel_tool_use: bool | None = None


class Type12(Enum):
    tool = 'tool'


class ToolChoiceTool(BaseModel):
    type: Literal['tool']
    name: str
    disable_parallel_tool_use: bool | None = None


class Type13(Enum):
    none = 'none'


class ToolChoiceNone(BaseModel):
    type: Literal['none']


class Type14(Enum):
    enabled = 'enabled'


class DisplayEnum(Enum):
    summarized = 'summarized'
    omitted = 'omitted'


class Display(RootModel[DisplayEnum | None]):
    root: DisplayEnum | None = None


class ThinkingEnabled(BaseModel):
    type: Literal['enabled']
    budget_tokens: int = Field(
        ...,
        description='The most thinking tokens; must be less than max_tokens.',
        ge=1024,
    )
    display: Display | None = None


class Type15(Enum):
    disabled = 'disabled'


class ThinkingDisabled(BaseModel):
    type: Literal['disabled']


class Type16(Enum):
    adaptive = 'adaptive'


class Display1Enum(Enum):
    summarized = 'summarized'
    omitted = 'omitted'


class Display1(RootModel[Display1Enum | None]):
    root: Display1Enum | None = None


class ThinkingAdaptive(BaseModel):
    type: Literal['adaptive']
    display: Display1 | None = None


class Type17(Enum):
    message = 'message'


class Role1(Enum):
    assistant = 'assistant'


class StopReasonEnum(Enum):
    end_turn = 'end_turn'
    max_tokens = 'max_tokens'
    stop_sequence = 'stop_sequence'
    tool_use = 'tool_use'


class StopReason(RootModel[StopReasonEnum | None]):
    root: StopReasonEnum | None = None


class Type18(Enum):
    text = 'text'


class TextBlock(BaseModel):
    type: Literal['text']
    text: str


class Type19(Enum):
    thinking = 'thinking'


class ThinkingBlock(BaseModel):
    type: Literal['thinking']
    thinking: str
    signature: str = Field(
        ...,
        description='Empty (the server signs nothing; a thinking block sent back is taken as it is).',
    )


class Type20(Enum):
    tool_use = 'tool_use'


class ToolUseBlock(BaseModel):
    type: Literal['tool_use']
    id: str = Field(..., examples=['toolu_01A09q90qw90lq917835lq9'])
    name: str
    input: dict[str, Any]


class Usage(BaseModel):
    input_tokens: int = Field(..., ge=0)
    output_tokens: int = Field(..., ge=0)
    cache_read_input_tokens: int | None = Field(
        None, description='Prompt tokens served from the prefix cache.', ge=0
    )
    cache_creation_input_tokens: int | None = Field(None, ge=0)


class MessageTokensCount(BaseModel):
    input_tokens: int = Field(..., ge=0)


class Type21(Enum):
    message_start = 'message_start'


class Type22(Enum):
    content_block_start = 'content_block_start'


class Type23(Enum):
    content_block_delta = 'content_block_delta'


class Type24(Enum):
    text_delta = 'text_delta'


class TextDelta(BaseModel):
    type: Literal['text_delta']
    text: str


class Type25(Enum):
    input_json_delta = 'input_json_delta'


class InputJsonDelta(BaseModel):
    type: Literal['input_json_delta']
    partial_json: str


class Type26(Enum):
    thinking_delta = 'thinking_delta'


class ThinkingDelta(BaseModel):
    type: Literal['thinking_delta']
    thinking: str


class Type27(Enum):
    signature_delta = 'signature_delta'


class SignatureDelta(BaseModel):
    type: Literal['signature_delta']
    signature: str


class Type28(Enum):
    content_block_stop = 'content_block_stop'


class ContentBlockStopEvent(BaseModel):
    type: Literal['content_block_stop']
    index: int = Field(..., ge=0)


class Type29(Enum):
    message_delta = 'message_delta'


class Delta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = Field(...)


class MessageDeltaUsage(BaseModel):
    output_tokens: int = Field(..., ge=0)
    input_tokens: int | None = Field(None, ge=0)
    cache_read_input_tokens: int | None = Field(None, ge=0)


class Type30(Enum):
    message_stop = 'message_stop'


class MessageStopEvent(BaseModel):
    type: Literal['message_stop']


class Type31(Enum):
    ping = 'ping'


class PingEvent(BaseModel):
    type: Literal['ping']


class Type32(Enum):
    error = 'error'


class Type33(Enum):
    invalid_request_error = 'invalid_request_error'
    authentication_error = 'authentication_error'
    permission_error = 'permission_error'
    not_found_error = 'not_found_error'
    request_too_large = 'request_too_large'
    rate_limit_error = 'rate_limit_error'
    api_error = 'api_error'
    overloaded_error = 'overloaded_error'


class Error(BaseModel):
    type: Type33
    message: str


class ErrorResponse(BaseModel):
    type: Literal['error']
    error: Error


class OutputConfig(BaseModel):
    effort: Effort | None = Field(
        None,
        description='How much the model may think (a thinking budget; see docs/differences-from-tgi.md).',
    )
    format: JsonOutputFormat | None = None


class ToolResultBlockParam(BaseModel):
    type: Literal['tool_result']
    tool_use_id: str
    content: (
        str
        | list[
            Annotated[TextBlockParam | ImageBlockParam | DocumentBlockParam, Field(discriminator='type')]
        ]
        | None
    ) = None
    is_error: bool | None = None


class ContentBlockStartEvent(BaseModel):
    type: Literal['content_block_start']
    index: int = Field(..., ge=0)
    content_block: TextBlock | ThinkingBlock | ToolUseBlock = Field(
        ..., discriminator='type'
    )


class MessageDeltaEvent(BaseModel):
    type: Literal['message_delta']
    delta: Delta
    usage: MessageDeltaUsage


class Message(BaseModel):
    id: str = Field(..., examples=['msg_013Zva2CMHLNnXjNJJKqJ2EF'])
    type: Type17
    role: Role1
    content: list[
        Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator='type')]
    ]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = Field(...)
    usage: Usage


class MessageStartEvent(BaseModel):
    type: Literal['message_start']
    message: Message


class ContentBlockDeltaEvent(BaseModel):
    type: Literal['content_block_delta']
    index: int = Field(..., ge=0)
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta = Field(
        ..., discriminator='type'
    )


class InputMessage(BaseModel):
    role: Role
    content: str | list[Annotated[TextBlockParam | ImageBlockParam | DocumentBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam | RedactedThinkingBlockParam, Field(discriminator='type')]]


class MessageStreamEvent(
    RootModel[
        MessageStartEvent
        | ContentBlockStartEvent
        | ContentBlockDeltaEvent
        | ContentBlockStopEvent
        | MessageDeltaEvent
        | MessageStopEvent
        | PingEvent
        | ErrorResponse
    ]
):
    root: (
        MessageStartEvent
        | ContentBlockStartEvent
        | ContentBlockDeltaEvent
        | ContentBlockStopEvent
        | MessageDeltaEvent
        | MessageStopEvent
        | PingEvent
        | ErrorResponse
    ) = Field(..., discriminator='type')


class MessagesRequest(BaseModel):
    model: str = Field(..., description='Any name; the served model answers.')
    messages: list[InputMessage]
    max_tokens: int = Field(
        ..., description='The most tokens to generate (thinking included).', ge=1
    )
    system: str | list[TextBlockParam] | None = Field(
        None, description='A string, or text blocks joined in order.'
    )
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = Field(
        None,
        description='Custom strings that end the turn (`stop_reason` "stop_sequence").',
    )
    stream: bool = False
    temperature: float | None = Field(
        None, description='Default 1.0; 0 is greedy.', ge=0.0, le=1.0
    )
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: (
        ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone | None
    ) = Field(None, discriminator='type')
    thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None = Field(
        None, discriminator='type'
    )
    output_config: OutputConfig | None = None


class CountTokensRequest(BaseModel):
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlockParam] | None = Field(
        None, description='A string, or text blocks joined in order.'
    )
    tools: list[Tool] | None = None
    tool_choice: (
        ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone | None
    ) = Field(None, discriminator='type')
    thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None = Field(
        None, discriminator='type'
    )
