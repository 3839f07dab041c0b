# GENERATED from openapi/tgi.json (sha256 f01cd899c33d06cc) by codegen with
# datamodel-code-generator 0.86.0. DO NOT EDIT BY HAND: change the document
# and regenerate with `python -m codegen` (CI runs `python -m codegen --check`).

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, RootModel


class ChatCompletionTopLogprob(BaseModel):
    logprob: float
    token: str


class Object(Enum):
    text_completion = 'text_completion'


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class FinishReason(Enum):
    length = 'length'
    eos_token = 'eos_token'
    stop_sequence = 'stop_sequence'


class Function(BaseModel):
    arguments: str
    name: str | None = None


class FunctionDefinition(BaseModel):
    arguments: Any | None = Field(
        None,
        description="In a request's `tools`: the function's parameters as a JSON schema (TGI's name; OpenAI's is `parameters`). In a response's `tool_calls`: the arguments, a string holding JSON.",
    )
    description: str | None = None
    name: str
    parameters: Any | None = Field(
        None,
        description="OpenAI's name for a tool's JSON schema (TGI's `arguments`, of which it is an alias in a request).",
    )


class FunctionName(BaseModel):
    name: str


class Type(Enum):
    json = 'json'


class JsonGrammar(BaseModel):
    type: Literal['json']
    value: Any = Field(
        ...,
        description='A string that represents a [JSON Schema](https://json-schema.org/).\n\nJSON Schema is a declarative language that allows to annotate JSON documents\nwith types and descriptions.',
    )


class Type1(Enum):
    regex = 'regex'


class RegexGrammar(BaseModel):
    type: Literal['regex']
    value: str


class ModelKind(Enum):
    generation = 'generation'
    embedding = 'embedding'
    rerank = 'rerank'
    classification = 'classification'


class Info(BaseModel):
    docker_label: str | None = Field(None, examples=[None])
    max_batch_size: int | None = Field(None, examples=[None], ge=0)
    max_batch_total_tokens: int = Field(..., examples=[32000], ge=0)
    max_best_of: int = Field(..., examples=[2], ge=0)
    max_client_batch_size: int = Field(..., examples=[32], ge=0)
    max_concurrent_requests: int = Field(
        ..., description='Router Parameters', examples=[128], ge=0
    )
    max_input_tokens: int = Field(..., examples=[1024], ge=0)
    max_stop_sequences: int = Field(..., examples=[4], ge=0)
    max_total_tokens: int = Field(..., examples=[2048], ge=0)
    max_waiting_tokens: int = Field(..., examples=[20], ge=0)
    model_device_type: str = Field(..., examples=['cuda'])
    model_dtype: str = Field(..., examples=['torch.float16'])
    model_id: str = Field(
        ..., description='Model info', examples=['bigscience/blomm-560m']
    )
    model_pipeline_tag: str | None = Field(None, examples=['text-generation'])
    model_sha: str | None = Field(
        None, examples=['e985a63cdc139290c5f700ff1929f0b5942cced2']
    )
    router: str = Field(
        ..., description='Router Info', examples=['text-generation-router']
    )
    sha: str | None = Field(None, examples=[None])
    validation_workers: int = Field(..., examples=[2], ge=0)
    version: str = Field(..., examples=['0.5.0'])
    waiting_served_ratio: float = Field(..., examples=[1.2])
    adapters: list[str] | None = Field(
        None,
        description='LoRA adapters loaded with --lora-adapters (an opentgi addition)',
        examples=[['my-lora']],
    )
    deterministic: bool | None = Field(
        None,
        description="true (the default): batch-invariant inference, a request's tokens and logprobs do not depend on the other requests in its batch nor on how its prompt was computed (prefix-cache hit, chunked prefill); false when started with --nondeterministic (an opentgi addition)",
        examples=[True],
    )
    kernels: str | None = Field(
        None,
        description="The matmul path of a GGUF's quantized layers: `native (<instruction set>)` when the native CPU kernels serve them, `torch (<why>)` otherwise (--kernels; an opentgi addition)",
        examples=['native (avx2)'],
    )
    kv_cache_dtype: str | None = Field(
        None,
        description="The paged KV cache's dtype (--kv-cache-dtype: by default float16 where the model computes in float32 on CPU, else the model's); null where the model has no paged cache (an opentgi addition)",
        examples=['float16'],
    )
    model_architecture: str | None = Field(
        None,
        description="The served model's architecture, a transformers class name (an opentgi addition)",
        examples=['LlamaForCausalLM'],
    )
    supported_architectures: list[str] | None = Field(
        None,
        description='The architectures served natively on the paged path (paged KV cache, prefix cache, every engine feature); a model of another architecture runs on the generic transformers path (an opentgi addition)',
        examples=[['LlamaForCausalLM', 'Gemma2ForCausalLM']],
    )
    model_kind: ModelKind | None = Field(
        None,
        description='What the served model does: generation, or a pooling model (embedding: /v1/embeddings and /embed; rerank: /v1/rerank, /rerank and /predict; classification: /predict) (an opentgi addition)',
        examples=['generation'],
    )


class Type2(Enum):
    text = 'text'


class TextChunk(BaseModel):
    text: str
    type: Literal['text']


class Type3(Enum):
    image_url = 'image_url'


class PrefillToken(BaseModel):
    id: int = Field(..., examples=[0], ge=0)
    logprob: float | None = Field(..., examples=[-0.34])
    text: str = Field(..., examples=['test'])


class SimpleToken(BaseModel):
    id: int = Field(..., examples=[0], ge=0)
    start: int = Field(..., examples=[0], ge=0)
    stop: int = Field(..., examples=[2], ge=0)
    text: str = Field(..., examples=['test'])


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int = Field(..., examples=[1], ge=0)
    seed: int | None = Field(None, examples=[42], ge=0)


class TextMessage(BaseModel):
    content: str = Field(..., examples=['My name is David and I'])
    role: str = Field(..., examples=['user'])
    reasoning_content: str | None = Field(
        None,
        description="The model's thinking (the text between its template's `<think>` and `</think>`), as vLLM's `reasoning_content`.",
    )


class Token(BaseModel):
    id: int = Field(..., examples=[0], ge=0)
    logprob: float | None = Field(..., examples=[-0.34])
    special: bool = Field(..., examples=[False])
    text: str = Field(..., examples=['test'])


class Tool(BaseModel):
    function: FunctionDefinition
    type: str = Field(..., examples=['function'])


class ToolCall(BaseModel):
    function: FunctionDefinition
    id: str
    type: str


class ToolCallMessage(BaseModel):
    role: str = Field(..., examples=['assistant'])
    tool_calls: list[ToolCall]
    reasoning_content: str | None = Field(
        None,
        description="The model's thinking (the text between its template's `<think>` and `</think>`), as vLLM's `reasoning_content`.",
    )
    content: str | None = Field(
        None, description='Text the model wrote beside its calls (null when none).'
    )


class FunctionChoice(BaseModel):
    function: FunctionName


class Url(BaseModel):
    url: str


class StreamOptions(BaseModel):
    include_usage: bool | None = Field(
        None,
        description='If set, an additional chunk is streamed before `data: [DONE]`: its `usage` holds the token counts of the whole request and its `choices` is empty. Every other chunk has `usage: null`.',
    )


class LogitBias3(RootModel[float]):
    root: float = Field(..., ge=-100.0, le=100.0)


class JsonSchemaFormat(BaseModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias='schema', description='The JSON schema the answer must satisfy.'
    )
    strict: bool | None = None


class Type4(Enum):
    text = 'text'


class TextFormat(BaseModel):
    type: Type4


class Type5(Enum):
    json_object = 'json_object'


class JsonObjectFormat(BaseModel):
    type: Type5


class Type6(Enum):
    json_schema = 'json_schema'


class JsonSchemaResponseFormat(BaseModel):
    type: Type6
    json_schema: JsonSchemaFormat


class TextOffsetItem(RootModel[int]):
    root: int = Field(..., ge=0)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[TextOffsetItem]


class ModelInfo(BaseModel):
    id: str = Field(..., examples=['HuggingFaceTB/SmolLM2-135M-Instruct'])
    object: str = Field(..., examples=['model'])
    created: int = Field(..., examples=[1706270835], ge=0)
    owned_by: str = Field(..., examples=['HuggingFaceTB/SmolLM2-135M-Instruct'])
    parent: str | None = Field(
        None, description="For a LoRA adapter: the base model's id", examples=[None]
    )
    model_kind: ModelKind | None = Field(
        None,
        description='What the served model does: generation, or a pooling model (embedding: /v1/embeddings and /embed; rerank: /v1/rerank, /rerank and /predict; classification: /predict) (an opentgi addition)',
        examples=['generation'],
    )


class ModelsInfo(BaseModel):
    object: str = Field(..., examples=['list'])
    data: list[ModelInfo]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        ...,
        description='Prompt tokens whose KV cache was reused from the prefix cache.',
        ge=0,
    )


class ChatTokenizeResponse(BaseModel):
    templated_text: str = Field(
        ..., description="The messages rendered by the model's chat template."
    )
    tokenize_response: list[SimpleToken]


class Token1(RootModel[int]):
    root: int = Field(..., ge=0)


class DetokenizeRequest(BaseModel):
    tokens: list[Token1] = Field(..., examples=[[1, 2, 3]])
    skip_special_tokens: bool | None = Field(
        False, description='Leave special tokens out of the text.'
    )
    model: str | None = Field(None, description="Accepted and ignored (vLLM's field).")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(..., examples=['test'])


class BestOfSequence(BaseModel):
    finish_reason: FinishReason
    generated_text: str = Field(..., examples=['test'])
    generated_tokens: int = Field(..., examples=[1], ge=0)
    prefill: list[PrefillToken]
    seed: int | None = Field(None, examples=[42], ge=0)
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class ChatCompletionLogprob(BaseModel):
    logprob: float
    token: str
    top_logprobs: list[ChatCompletionTopLogprob]


class ChatCompletionLogprobs(BaseModel):
    content: list[ChatCompletionLogprob]


class CompletionComplete(BaseModel):
    finish_reason: str | None = Field(...)
    index: int = Field(..., ge=0)
    logprobs: list[float] | CompletionLogprobs | None = None
    text: str


class CompletionRequest(BaseModel):
    frequency_penalty: float | None = Field(
        None,
        description="Number between -2.0 and 2.0. Positive values penalize new tokens based on their existing frequency in the text so far,\ndecreasing the model's likelihood to repeat the same line verbatim.",
        examples=[1.0],
    )
    max_tokens: int | None = Field(
        32,
        description='The maximum number of tokens that can be generated in the chat completion.',
        ge=0,
    )
    model: str | None = Field(
        None,
        description='UNUSED\nID of the model to use. See the model endpoint compatibility table for details on which models work with the Chat API.',
        examples=['mistralai/Mistral-7B-Instruct-v0.2'],
    )
    prompt: str | list[str] = Field(
        ...,
        description='One prompt, or a list of prompts (each its own choices, at most max_client_batch_size).',
    )
    repetition_penalty: float | None = None
    seed: int | None = Field(None, examples=[42], ge=0)
    stop: str | list[str] | None = None
    stream: bool | None = None
    suffix: str | None = Field(
        None,
        description="Text that comes after the completion: fill-in-the-middle, built from the tokenizer's FIM tokens or the server's --fim-template.",
    )
    temperature: float | None = Field(
        None,
        description='What sampling temperature to use, between 0 and 2. Higher values like 0.8 will make the output more random, while\nlower values like 0.2 will make it more focused and deterministic. We generally recommend altering this or `top_p` but not both.',
        examples=[1.0],
    )
    top_p: float | None = Field(
        None,
        description='An alternative to sampling with temperature, called nucleus sampling, where the model considers the results of the\ntokens with top_p probability mass. So 0.1 means only the tokens comprising the top 10% probability mass are considered.',
        examples=[0.95],
    )
    n: int | None = Field(
        None, description='How many completions to generate for each prompt.', ge=0
    )
    echo: bool | None = Field(
        None, description='Echo back the prompt in addition to the completion.'
    )
    logprobs: int | None = Field(
        None,
        description='Include the log probabilities of the output tokens and of this many most likely tokens at each position.',
        ge=0,
    )
    presence_penalty: float | None = Field(
        None,
        description='Number between -2.0 and 2.0: penalizes tokens already present.',
    )
    logit_bias: dict[str, LogitBias3] | None = None
    stream_options: StreamOptions | None = None
    min_p: float | None = Field(
        None,
        description="Min-p sampling (vLLM's extension): tokens less likely than `min_p` times the most likely token's probability are left out (0: off).",
        examples=[0.05],
        ge=0.0,
        le=1.0,
    )


class DeltaToolCall(BaseModel):
    function: Function | None = None
    id: str | None = None
    index: int = Field(..., ge=0)
    type: str | None = None


class Details(BaseModel):
    best_of_sequences: list[BestOfSequence] | None = None
    finish_reason: FinishReason
    generated_tokens: int = Field(..., examples=[1], ge=0)
    prefill: list[PrefillToken]
    seed: int | None = Field(None, examples=[42], ge=0)
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class GenerateParameters(BaseModel):
    adapter_id: str | None = Field(None, description='Lora adapter id', examples=[None])
    best_of: int | None = Field(
        None,
        description='Generate best_of sequences and return the one if the highest token logprobs.',
        examples=[1],
        ge=0,
    )
    decoder_input_details: bool = Field(
        False, description='Whether to return decoder input token logprobs and ids.'
    )
    details: bool = Field(False, description='Whether to return generation details.')
    do_sample: bool = Field(
        False, description='Activate logits sampling.', examples=[True]
    )
    frequency_penalty: float | None = Field(
        None,
        description="The parameter for frequency penalty. 1.0 means no penalty\nPenalize new tokens based on their existing frequency in the text so far,\ndecreasing the model's likelihood to repeat the same line verbatim.",
        examples=[0.1],
        ge=-2.0,
    )
    grammar: JsonGrammar | RegexGrammar | None = None
    max_new_tokens: int | None = Field(
        100, description='Maximum number of tokens to generate.', examples=[20], ge=0
    )
    repetition_penalty: float | None = Field(
        None,
        description='The parameter for repetition penalty. 1.0 means no penalty.\nSee [this paper](https://arxiv.org/pdf/1909.05858.pdf) for more details.',
        examples=[1.03],
        gt=0.0,
    )
    return_full_text: bool | None = Field(
        None,
        description='Whether to prepend the prompt to the generated text',
        examples=[False],
    )
    seed: int | None = Field(
        None, description='Random sampling seed.', examples=[None], ge=0
    )
    stop: list[str] | None = Field(
        None,
        description='Stop generating tokens if a member of `stop` is generated.',
        examples=[['photographer']],
    )
    temperature: float | None = Field(
        None,
        description='The value used to module the logits distribution.',
        examples=[0.5],
        gt=0.0,
    )
    top_k: int | None = Field(
        None,
        description='The number of highest probability vocabulary tokens to keep for top-k-filtering.',
        examples=[10],
        gt=0,
    )
    top_n_tokens: int | None = Field(
        None,
        description='The number of highest probability vocabulary tokens to keep for top-n-filtering.',
        examples=[5],
        ge=0,
    )
    top_p: float | None = Field(
        None,
        description='Top-p value for nucleus sampling.',
        examples=[0.95],
        gt=0.0,
        le=1.0,
    )
    truncate: int | None = Field(
        None,
        description='Truncate inputs tokens to the given size.',
        examples=[None],
        ge=0,
    )
    typical_p: float | None = Field(
        None,
        description='Typical Decoding mass\nSee [Typical Decoding for Natural Language Generation](https://arxiv.org/abs/2202.00666) for more information.',
        examples=[0.95],
        gt=0.0,
        le=1.0,
    )
    watermark: bool = Field(
        False,
        description='Watermarking with [A Watermark for Large Language Models](https://arxiv.org/abs/2301.10226).',
        examples=[True],
    )
    min_p: float | None = Field(
        None,
        description="Min-p sampling (an extension of TGI's parameters, as vLLM's): tokens less likely than `min_p` times the most likely token's probability are left out (0 or null: off).",
        examples=[0.05],
        ge=0.0,
        le=1.0,
    )


class GenerateRequest(BaseModel):
    inputs: str = Field(..., examples=['My name is Olivier and I'])
    parameters: GenerateParameters | None = None


class GenerateResponse(BaseModel):
    details: Details | None = None
    generated_text: str = Field(..., examples=['test'])


class ImageUrlChunk(BaseModel):
    image_url: Url
    type: Literal['image_url']


class StreamResponse(BaseModel):
    details: StreamDetails | None = None
    generated_text: str | None = Field(None, examples=['test'])
    index: int = Field(..., ge=0)
    token: Token
    top_tokens: list[Token] | None = None


class ToolCallDelta(BaseModel):
    role: str = Field(..., examples=['assistant'])
    tool_calls: DeltaToolCall


class Usage(BaseModel):
    completion_tokens: int = Field(..., ge=0)
    prompt_tokens: int = Field(..., ge=0)
    total_tokens: int = Field(..., ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionStreamDelta(BaseModel):
    role: str | None = Field(None, examples=['assistant'])
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = Field(
        None,
        description="The model's thinking (the text between its template's `<think>` and `</think>`), as vLLM's `reasoning_content`.",
    )


class ChatCompletionComplete(BaseModel):
    finish_reason: str
    index: int = Field(..., ge=0)
    logprobs: ChatCompletionLogprobs | None = None
    message: TextMessage | ToolCallMessage


class Chunk(BaseModel):
    choices: list[CompletionComplete]
    created: int = Field(..., ge=0)
    id: str
    model: str
    system_fingerprint: str
    object: str | None = Field(None, examples=['text_completion'])
    usage: Usage | None = None


class CompatGenerateRequest(BaseModel):
    inputs: str = Field(..., examples=['My name is Olivier and I'])
    parameters: GenerateParameters | None = None
    stream: bool = False


class Completion1(Chunk):
    object: Object = Field(..., examples=['text_completion'])


class CompletionFinal(BaseModel):
    choices: list[CompletionComplete]
    created: int = Field(..., examples=[1706270835], ge=0)
    id: str
    model: str = Field(..., examples=['mistralai/Mistral-7B-Instruct-v0.2'])
    system_fingerprint: str
    usage: Usage
    object: str | None = Field(None, examples=['text_completion'])


class Message(BaseModel):
    content: (
        str
        | list[Annotated[TextChunk | ImageUrlChunk, Field(discriminator='type')]]
        | None
    ) = None
    name: str | None = Field(None, examples=['"David"'])
    role: str = Field(..., examples=['user'])
    tool_calls: list[ToolCall] | None = Field(
        None, description='The tool calls of an assistant message.'
    )
    tool_call_id: str | None = Field(
        None, description='The call a `tool` message answers.'
    )
    reasoning_content: str | None = Field(
        None,
        description="An assistant turn's thinking, shown to templates that render it.",
    )


class ChatCompletion(BaseModel):
    choices: list[ChatCompletionComplete]
    created: int = Field(..., examples=[1706270835], ge=0)
    id: str
    model: str = Field(..., examples=['mistralai/Mistral-7B-Instruct-v0.2'])
    system_fingerprint: str
    usage: Usage
    object: str | None = Field(None, examples=['chat.completion'])


class ChatCompletionChoice(BaseModel):
    delta: TextMessage | ToolCallDelta | ChatCompletionStreamDelta
    finish_reason: str | None = None
    index: int = Field(..., ge=0)
    logprobs: ChatCompletionLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    choices: list[ChatCompletionChoice]
    created: int = Field(..., examples=[1706270978], ge=0)
    id: str
    model: str = Field(..., examples=['mistralai/Mistral-7B-Instruct-v0.2'])
    system_fingerprint: str
    object: str | None = Field(None, examples=['chat.completion.chunk'])
    usage: Usage | None = None


class ChatRequest(BaseModel):
    frequency_penalty: float | None = Field(
        None,
        description="Number between -2.0 and 2.0. Positive values penalize new tokens based on their existing frequency in the text so far,\ndecreasing the model's likelihood to repeat the same line verbatim.",
        examples=[1.0],
    )
    logit_bias: list[float] | dict[str, LogitBias3] | None = Field(
        None,
        description='Modify the likelihood of specified tokens appearing in the completion: an object that maps token ids to a bias from -100 to 100, added to the logits before sampling.',
    )
    logprobs: bool | None = Field(
        None,
        description='Whether to return log probabilities of the output tokens or not. If true, returns the log probabilities of each\noutput token returned in the content of message.',
        examples=[False],
    )
    max_tokens: int | None = Field(
        None,
        description='The maximum number of tokens that can be generated in the chat completion.',
        examples=[32],
        ge=0,
    )
    messages: list[Message] = Field(
        ...,
        description='A list of messages comprising the conversation so far.',
        examples=[[{'role': 'user', 'content': 'What is Deep Learning?'}]],
    )
    model: str | None = Field(
        None,
        description='[UNUSED] ID of the model to use. See the model endpoint compatibility table for details on which models work with the Chat API.',
        examples=['mistralai/Mistral-7B-Instruct-v0.2'],
    )
    n: int | None = Field(
        None,
        description='How many chat completion choices to generate for each input message (at most max_client_batch_size).',
        examples=[2],
        ge=0,
    )
    presence_penalty: float | None = Field(
        None,
        description="Number between -2.0 and 2.0. Positive values penalize new tokens based on whether they appear in the text so far,\nincreasing the model's likelihood to talk about new topics",
        examples=[0.1],
    )
    response_format: (
        JsonGrammar
        | RegexGrammar
        | TextFormat
        | JsonObjectFormat
        | JsonSchemaResponseFormat
        | None
    ) = None
    seed: int | None = Field(None, examples=[42], ge=0)
    stop: str | list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(
        None,
        description='What sampling temperature to use, between 0 and 2. Higher values like 0.8 will make the output more random, while\nlower values like 0.2 will make it more focused and deterministic.\n\nWe generally recommend altering this or `top_p` but not both.',
        examples=[1.0],
    )
    tool_choice: str | FunctionChoice | None = None
    tool_prompt: str | None = Field(
        None,
        description='A prompt to be appended before the tools',
        examples=['"You will be presented with a JSON schema representing a set of tools.\nIf the user request lacks of sufficient information to make a precise tool selection: Do not invent any tool\'s properties, instead notify with an error message.\n\nJSON Schema:\n"'],
    )
    tools: list[Tool] | None = Field(
        None,
        description='A list of tools the model may call. Currently, only functions are supported as a tool. Use this to provide a list of\nfunctions the model may generate JSON inputs for.',
        examples=[None],
    )
    top_logprobs: int | None = Field(
        None,
        description='An integer between 0 and 5 specifying the number of most likely tokens to return at each token position, each with\nan associated log probability. logprobs must be set to true if this parameter is used.',
        examples=[5],
        ge=0,
    )
    top_p: float | None = Field(
        None,
        description='An alternative to sampling with temperature, called nucleus sampling, where the model considers the results of the\ntokens with top_p probability mass. So 0.1 means only the tokens comprising the top 10% probability mass are considered.',
        examples=[0.95],
    )
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(
        None,
        description="OpenAI's newer name for `max_tokens` (used when `max_tokens` is not set).",
        ge=0,
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='More variables for the model\'s chat template (vLLM\'s extension), e.g. `{"enable_thinking": false}`; they win over the server\'s `--chat-template-kwargs`.',
        examples=[{'enable_thinking': False}],
    )
    reasoning_effort: str | None = Field(
        None,
        description="OpenAI's reasoning effort: `minimal`, `low`, `medium` or `high`; for a model that thinks (`<think>` in its template), the thinking tokens allowed before `</think>` is forced (256, 1024, 4096, no limit).",
        examples=['low'],
    )
    parallel_tool_calls: bool | None = Field(
        None,
        description='Whether the model may call several tools in one turn (default true); false ends the turn after its first call.',
        examples=[True],
    )
    min_p: float | None = Field(
        None,
        description="Min-p sampling (vLLM's extension): tokens less likely than `min_p` times the most likely token's probability are left out (0: off).",
        examples=[0.05],
        ge=0.0,
        le=1.0,
    )


class Completion2(CompletionFinal):
    object: Object = Field(..., examples=['text_completion'])


class Completion(RootModel[Completion1 | Completion2]):
    root: Completion1 | Completion2
