"""OpenAI's Responses API (openapi/openai-responses.yaml): thin handlers over the shared chat turn.

`POST /v1/responses`: the stored conversation of `previous_response_id` plus the new input in OpenAI
chat form (`items.py`), `instructions` first -> `prepare_chat_turn` -> one engine request through the
one request path -> a Response whose output items (`output.py`) are the parser's reasoning, text and
function calls, or their numbered stream of events (`stream.py`). Responses with `store` (the
default) are kept in the bounded store (`store.py`) for `GET` / `DELETE /v1/responses/{id}` and
follow-ups.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from opentgi.api import generation, runtime
from opentgi.api.adapters import adapter_named_by_model, served_model_name
from opentgi.api.chat import (
    ChatMessage,
    ChatTurn,
    PreparedTurn,
    ReasoningDelta,
    prepare_chat_turn,
    reasoning_budget_for_effort,
)
from opentgi.api.errors import IncompleteGenerationError
from opentgi.api.generation import ErrorPolicy, Generation
from opentgi.api.openai import common
from opentgi.api.openai.params import response_format_grammar
from opentgi.api.responses import items as convert
from opentgi.api.responses import output as shapes
from opentgi.api.responses.errors import ResponseNotFoundError, error_event, openai_error
from opentgi.api.responses.store import ResponseStore, StoredResponse
from opentgi.api.responses.stream import ResponseEvents
from opentgi.api.sse import NamedEvent
from opentgi.engine.errors import InputTooLongError, ValidationError
from opentgi.engine.events import GenerationResult, SequenceResult
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.schemas import openai_responses as schema

ERROR_POLICY = ErrorPolicy(error=openai_error, stream_error=error_event)
# OpenAI's efforts past the shared chat turn's table: "none" turns thinking off, "xhigh" is "high".
EFFORT_ALIASES = {"xhigh": "high"}


def response_store() -> ResponseStore:
    state = runtime.state()
    if state.responses is None:
        state.responses = ResponseStore(state.settings.responses_store_size)
    return state.responses


def reasoning_options(reasoning: schema.ReasoningConfig | None) -> tuple[dict | None, int | None]:
    """(chat_template_kwargs, reasoning budget) for `reasoning.effort`."""
    effort = reasoning.model_dump(mode="json").get("effort") if reasoning is not None else None
    if effort == "none":
        return {"enable_thinking": False}, None
    return None, reasoning_budget_for_effort(EFFORT_ALIASES.get(effort, effort))


def sampling_params(request: schema.CreateResponseRequest) -> SamplingParams:
    """OpenAI's defaults: temperature 1, top_p 1; temperature 0 (or top_p 0) is greedy."""
    if request.temperature == 0 or request.top_p == 0:
        return SamplingParams(do_sample=False)
    return SamplingParams(do_sample=True, temperature=1.0 if request.temperature is None else request.temperature,
                          top_p=1.0 if request.top_p is None else request.top_p)


def output_budget(requested: int | None, num_prompt_tokens: int, max_input_tokens: int, max_total_tokens: int) -> int:
    """`max_output_tokens`, or what still fits in --max-total-tokens."""
    if num_prompt_tokens > max_input_tokens:
        raise InputTooLongError(f"the input is too long: {num_prompt_tokens} tokens > {max_input_tokens} maximum",
                                input_tokens=num_prompt_tokens, max_new_tokens=requested, limit=max_input_tokens)
    budget = requested if requested is not None else max(1, max_total_tokens - num_prompt_tokens)
    if num_prompt_tokens + budget > max_total_tokens:
        raise InputTooLongError(
            f"input tokens + max_output_tokens must be <= {max_total_tokens}. Given: {num_prompt_tokens} input "
            f"tokens and {budget} max_output_tokens", input_tokens=num_prompt_tokens, max_new_tokens=budget,
            limit=max_total_tokens)
    return budget


@dataclass
class PreparedResponse:
    meta: shapes.ResponseMeta
    turn: PreparedTurn
    num_prompt_tokens: int
    conversation: list[dict]  # earlier turns and this input, instructions excluded (what is stored)
    store: bool
    events: ResponseEvents

    @property
    def sequence(self):
        """The stream's event numbers (its error event takes the next one)."""
        return self.events.sequence


async def _prepare_response(body: dict) -> tuple[list[GenerationRequest], PreparedResponse]:
    state = runtime.state()
    engine, info = state.engine, state.engine.info
    request = common.parse_model(schema.CreateResponseRequest, body)
    conversation = []
    if request.previous_response_id is not None:
        previous = response_store().get(request.previous_response_id)
        if previous is None:
            raise ResponseNotFoundError(request.previous_response_id, "previous_response_id")
        conversation = list(previous.conversation)
    conversation += convert.input_messages(request.input, bool(getattr(info, "image_input", False)))
    if not conversation:
        raise ValidationError("input: a response needs input (or a previous_response_id)")
    tools = convert.chat_tools(request.tools)
    tool_choice = convert.chat_tool_choice(request.tool_choice, tools)
    kwargs, budget = reasoning_options(request.reasoning)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    turn = ChatTurn(messages=system + conversation, tools=tools, tool_choice=tool_choice,
                    parallel_tool_calls=request.parallel_tool_calls is not False,
                    response_format=convert.response_format(request.text), chat_template_kwargs=kwargs,
                    reasoning_budget=budget)
    format_grammar = response_format_grammar(turn.response_format, common.limits_of(state))
    prepared = await prepare_chat_turn(engine, turn, settings=state.settings, max_input_tokens=info.max_input_tokens,
                                       format_grammar=format_grammar)
    num_prompt = len(prepared.prompt_token_ids)
    max_tokens = output_budget(request.max_output_tokens, num_prompt, info.max_input_tokens, info.max_total_tokens)
    adapter = adapter_named_by_model(info, request.model)
    engine_request = GenerationRequest(
        prompt_token_ids=prepared.prompt_token_ids, sampling=sampling_params(request),
        stopping=StoppingParams(max_new_tokens=max_tokens, include_stop_str_in_output=False),
        needs_logprobs=False, grammar=prepared.grammar, reasoning=prepared.reasoning, adapter_id=adapter,
        images=prepared.images)
    meta = shapes.ResponseMeta(model=served_model_name(info, adapter),
                               echo=shapes.request_echo(request, tool_choice))
    return [engine_request], PreparedResponse(meta, prepared, num_prompt, conversation,
                                              store=request.store is not False, events=ResponseEvents(meta))


def _remember(p: PreparedResponse, response: dict, message: ChatMessage) -> None:
    if p.store:
        answer = convert.assistant_message(message.reasoning, message.content, message.tool_calls)
        response_store().put(response["id"], StoredResponse(response, [*p.conversation, answer]))


def _usage(p: PreparedResponse, result: GenerationResult, output_tokens: int, reasoning_tokens: int) -> dict:
    return shapes.usage(p.num_prompt_tokens, result.num_cached_tokens, output_tokens, reasoning_tokens,
                        prefix_caching=runtime.settings().enable_prefix_caching)


def _parse_counting(seq: SequenceResult, parser) -> tuple[ChatMessage, int]:
    """The sequence as one message, and how many of its tokens were thinking."""
    message, reasoning_tokens = ChatMessage(), 0
    for i, event in enumerate(seq.tokens):
        pieces = parser.feed(event) + (parser.finish() if i == len(seq.tokens) - 1 else [])
        reasoning_tokens += any(isinstance(piece, ReasoningDelta) for piece in pieces)
        for piece in pieces:
            message.add(piece)
    if message.tool_calls:
        message.content = message.content.strip()
    return message, reasoning_tokens


def _response_answer(gen: Generation, results: list[GenerationResult]) -> Response:
    p: PreparedResponse = gen.context
    (seq,) = results[0].sequences
    message, reasoning_tokens = _parse_counting(seq, p.turn.make_parser())
    incomplete = shapes.is_incomplete(seq.finish_reason)
    items = shapes.output_items(message.reasoning, message.content, message.tool_calls, incomplete)
    response = shapes.response_object(p.meta, "incomplete" if incomplete else "completed", items,
                                      _usage(p, results[0], len(seq.token_ids), reasoning_tokens))
    _remember(p, response, message)
    return JSONResponse(response)


async def _response_events(gen: Generation) -> AsyncIterator[NamedEvent]:
    p: PreparedResponse = gen.context
    events, parser, message = p.events, p.turn.make_parser(), ChatMessage()
    for out in events.start():
        yield out
    last, reasoning_tokens = None, 0
    async for event in gen.handle:
        pieces = parser.feed(event)
        if event.finish_reason is not None:
            pieces += parser.finish()
            last = event
        reasoning_tokens += any(isinstance(piece, ReasoningDelta) for piece in pieces)
        for piece in pieces:
            message.add(piece)
            for out in events.feed(piece):
                yield out
    if last is None:
        raise IncompleteGenerationError()
    result = await gen.handle.result()
    gen.success(last.generated_tokens, result.timings)
    finished = events.finish(shapes.is_incomplete(last.finish_reason),
                             _usage(p, result, last.generated_tokens, reasoning_tokens))
    _remember(p, finished[-1].data["response"], message)
    for out in finished:
        yield out


async def create_response(body: dict) -> Response:
    prepare = functools.partial(_prepare_response, body)
    if body.get("stream"):
        return await generation.stream(prepare, ERROR_POLICY, _response_events)
    return await generation.generate(prepare, ERROR_POLICY, _response_answer)


async def get_response(response_id: str) -> Response:
    stored = response_store().get(response_id)
    if stored is None:
        return openai_error(ResponseNotFoundError(response_id)).response()
    return JSONResponse(stored.response)


async def delete_response(response_id: str) -> Response:
    if not response_store().delete(response_id):
        return openai_error(ResponseNotFoundError(response_id)).response()
    return JSONResponse(schema.ResponseDeleted(id=response_id, object="response.deleted", deleted=True)
                        .model_dump(mode="json"))
