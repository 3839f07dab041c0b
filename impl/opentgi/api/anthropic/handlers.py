"""Anthropic's Messages API (openapi/anthropic.yaml): thin handlers over the shared chat turn.

`POST /v1/messages`: the request in OpenAI chat form (`messages.py`) -> `prepare_chat_turn` (prompt,
grammar, reasoning span, output parsers) -> one engine request through the one request path -> a
`message` whose blocks (`blocks.py`) are the parser's thinking, text and tool calls, or their
stream of named events. `POST /v1/messages/count_tokens`: the same prompt, counted.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from opentgi.api import generation, runtime
from opentgi.api.adapters import adapter_named_by_model, served_model_name
from opentgi.api.anthropic import blocks
from opentgi.api.anthropic import messages as convert
from opentgi.api.anthropic.errors import anthropic_error, error_event
from opentgi.api.chat import ChatTurn, PreparedTurn, parse_sequence, prepare_chat_turn
from opentgi.api.errors import IncompleteGenerationError
from opentgi.api.generation import ErrorPolicy, Generation
from opentgi.api.openai.common import limits_of, parse_model
from opentgi.api.openai.params import response_format_grammar
from opentgi.api.sse import NamedEvent
from opentgi.engine.errors import OpenTGIError
from opentgi.engine.events import GenerationResult
from opentgi.engine.request import FinishReason, GenerationRequest, StoppingParams
from opentgi.schemas import anthropic as schema

ERROR_POLICY = ErrorPolicy(error=anthropic_error, stream_error=error_event)


def chat_turn(request: schema.MessagesRequest | schema.CountTokensRequest) -> ChatTurn:
    tools = convert.chat_tools(request.tools)
    tool_choice, parallel = convert.chat_tool_choice(request.tool_choice, tools)
    kwargs, budget = convert.thinking_options(request.thinking, getattr(request, "max_tokens", None))
    response_format, effort_budget = convert.output_options(getattr(request, "output_config", None))
    images = bool(getattr(runtime.engine().info, "image_input", False))
    return ChatTurn(messages=convert.chat_messages(request.system, request.messages, images), tools=tools,
                    tool_choice=tool_choice, parallel_tool_calls=parallel, chat_template_kwargs=kwargs,
                    reasoning_budget=budget if budget is not None else effort_budget,
                    response_format=response_format)


async def _prepared_turn(request) -> PreparedTurn:
    state = runtime.state()
    turn = chat_turn(request)
    limits = limits_of(state)
    return await prepare_chat_turn(state.engine, turn, settings=state.settings,
                                   max_input_tokens=state.engine.info.max_input_tokens,
                                   format_grammar=response_format_grammar(turn.response_format, limits))


@dataclass
class PreparedMessage:
    id: str
    model: str
    turn: PreparedTurn
    num_prompt_tokens: int
    stop_sequences: list[str]


async def _prepare_message(body: dict) -> tuple[list[GenerationRequest], PreparedMessage]:
    state = runtime.state()
    info = state.engine.info
    request = parse_model(schema.MessagesRequest, body)
    stops = convert.stop_sequences(request.stop_sequences, state.settings.max_stop_sequences)
    sampling = convert.sampling_params(request)
    turn = await _prepared_turn(request)
    num_prompt = len(turn.prompt_token_ids)
    convert.check_lengths(num_prompt, request.max_tokens, info.max_input_tokens, info.max_total_tokens)
    adapter = adapter_named_by_model(info, request.model)
    engine_request = GenerationRequest(
        prompt_token_ids=turn.prompt_token_ids, sampling=sampling,
        stopping=StoppingParams(max_new_tokens=request.max_tokens, stop_sequences=stops,
                                include_stop_str_in_output=False),
        needs_logprobs=False, grammar=turn.grammar, reasoning=turn.reasoning, adapter_id=adapter,
        images=turn.images)
    return [engine_request], PreparedMessage(f"msg_{uuid.uuid4().hex}", served_model_name(info, adapter), turn, num_prompt, stops)


def _matched_stop(p: PreparedMessage, reason: FinishReason | None, token_ids: list[int]) -> str | None:
    if reason is not FinishReason.STOP_SEQUENCE or not p.stop_sequences:
        return None
    return convert.matched_stop_sequence(p.stop_sequences, runtime.engine().decode(token_ids))


def _message_answer(gen: Generation, results: list[GenerationResult]) -> Response:
    p: PreparedMessage = gen.context
    (seq,) = results[0].sequences
    message = parse_sequence(seq, p.turn.make_parser())
    used_tools = bool(message.tool_calls)
    reason = blocks.stop_reason(seq.finish_reason, used_tools)
    body = schema.Message(
        id=p.id, type="message", role="assistant", model=p.model,
        content=blocks.message_content(message.reasoning, message.content, message.tool_calls),
        stop_reason=reason,
        stop_sequence=_matched_stop(p, seq.finish_reason, seq.token_ids) if reason == "stop_sequence" else None,
        usage=schema.Usage(input_tokens=p.num_prompt_tokens, output_tokens=len(seq.token_ids),
                           cache_read_input_tokens=results[0].num_cached_tokens))
    return JSONResponse(body.model_dump(mode="json"))


async def _message_events(gen: Generation) -> AsyncIterator[NamedEvent]:
    p: PreparedMessage = gen.context
    start = {"id": p.id, "type": "message", "role": "assistant", "model": p.model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": p.num_prompt_tokens, "output_tokens": 0}}
    yield NamedEvent("message_start", {"type": "message_start", "message": start})
    yield NamedEvent("ping", {"type": "ping"})
    parser, stream = p.turn.make_parser(), blocks.BlockStream()
    token_ids: list[int] = []
    last = None
    async for event in gen.handle:
        token_ids.append(event.token_id)
        pieces = parser.feed(event)
        if event.finish_reason is not None:
            pieces += parser.finish()
            last = event
        for piece in pieces:
            for out in stream.feed(piece):
                yield out
    if last is None:
        raise IncompleteGenerationError()
    for out in stream.finish():
        yield out
    result = await gen.handle.result()
    gen.success(last.generated_tokens, result.timings)
    reason = blocks.stop_reason(last.finish_reason, stream.used_tools)
    stop = _matched_stop(p, last.finish_reason, token_ids) if reason == "stop_sequence" else None
    yield NamedEvent("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                                       "usage": {"input_tokens": p.num_prompt_tokens,
                                                 "output_tokens": last.generated_tokens,
                                                 "cache_read_input_tokens": result.num_cached_tokens}})
    yield NamedEvent("message_stop", {"type": "message_stop"})


async def create_message(body: dict) -> Response:
    prepare = functools.partial(_prepare_message, body)
    if body.get("stream"):
        return await generation.stream(prepare, ERROR_POLICY, _message_events)
    return await generation.generate(prepare, ERROR_POLICY, _message_answer)


async def count_tokens(body: dict) -> Response:
    try:
        request = parse_model(schema.CountTokensRequest, body)
        turn = await generation.unless_client_gone(_prepared_turn(request))
    except generation.ClientGone:
        return Response(status_code=generation.CLIENT_CLOSED_REQUEST)
    except OpenTGIError as exc:
        return anthropic_error(exc).response()
    return JSONResponse(schema.MessageTokensCount(input_tokens=len(turn.prompt_token_ids)).model_dump(mode="json"))
