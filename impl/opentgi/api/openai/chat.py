"""`POST /v1/chat/completions` (operationId `chat_completions`): messages -> chat template ->
one engine request with `n` sequences -> an OpenAI `chat.completion`, or `chat.completion.chunk`
events ending with `data: [DONE]`. Tools and `response_format` become the request's grammar."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from opentgi.api import generation, runtime
from opentgi.api.adapters import adapter_named_by_model, served_model_name
from opentgi.api.chat_template import render_chat
from opentgi.api.errors import IncompleteGenerationError
from opentgi.api.generation import Generation
from opentgi.api.openai import common
from opentgi.api.openai import shapes as shape
from opentgi.api.openai.params import (
    DEFAULT_MAX_TOKENS,
    OpenAILimits,
    check_n,
    check_seed,
    check_top_logprobs,
    max_new_tokens,
    response_format_grammar,
    sampling_params,
    stop_sequences,
    stopping_params,
)
from opentgi.api.openai.tools import (
    ToolAnswerStream,
    ToolError,
    new_tool_call_id,
    select_tools,
    tool_grammar_schema,
)
from opentgi.engine.events import TokenEvent
from opentgi.engine.request import FinishReason, GenerationRequest, GrammarSpec
from opentgi.schemas.tgi import ChatRequest


@dataclass
class PreparedChat:
    meta: shape.ResponseMeta
    num_prompt_tokens: int
    n: int
    using_tools: bool
    logprobs: bool
    include_usage: bool


def _chat_grammar(body: dict, limits: OpenAILimits) -> tuple[GrammarSpec | None, bool, list]:
    """The grammar (from tools or response_format), whether tools constrain the answer, and the
    tools to show the template."""
    tools = body.get("tools") or []
    selection = select_tools(tools, body.get("tool_choice"))
    response_format = body.get("response_format")
    format_grammar = response_format_grammar(response_format, limits)
    if selection.constrained:
        if format_grammar is not None:
            raise ToolError("Grammar and tools are mutually exclusive")
        if limits.disable_grammar_support:
            raise ToolError("Tools need grammar support, which this server has disabled")
        return GrammarSpec("json", json.dumps(tool_grammar_schema(selection))), True, tools
    return format_grammar, False, tools


async def _prepare_chat(body: dict) -> tuple[list[GenerationRequest], PreparedChat]:
    state = runtime.state()
    engine = state.engine
    limits = common.limits_of(state)
    req = common.parse_model(ChatRequest, body)
    grammar, using_tools, tools = _chat_grammar(body, limits)
    n = check_n(req.n, limits)
    check_seed(req.seed, n)
    logprobs = bool(req.logprobs)
    top_logprobs = check_top_logprobs("top_logprobs", req.top_logprobs, limits) if logprobs else 0
    stops = stop_sequences(req.stop, limits)
    sampling = sampling_params(temperature=req.temperature, top_p=req.top_p,
                               frequency_penalty=req.frequency_penalty,
                               presence_penalty=req.presence_penalty, seed=req.seed,
                               logit_bias=body.get("logit_bias"), limits=limits)
    template = engine.chat_template()
    text = await asyncio.to_thread(
        render_chat, template.template, body["messages"], bos_token=template.bos_token,
        eos_token=template.eos_token, special_tokens=template.special_tokens, tools=tools or None,
        tool_prompt=req.tool_prompt)
    prompt_ids = await engine.encode(text, add_special_tokens=False, max_tokens=limits.max_input_tokens)
    requested = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    budget = max_new_tokens(requested, DEFAULT_MAX_TOKENS, len(prompt_ids), limits)
    request = GenerationRequest(prompt_token_ids=prompt_ids, sampling=sampling,
                                stopping=stopping_params(budget, stops), n=n, top_n_tokens=top_logprobs,
                                top_n_ties=False,  # OpenAI's top_logprobs: exactly n
                                needs_logprobs=logprobs,
                                grammar=grammar, adapter_id=adapter_named_by_model(engine.info, req.model))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    model = served_model_name(engine.info, request.adapter_id)
    return [request], PreparedChat(meta=shape.ResponseMeta.new("chatcmpl", model),
                                   num_prompt_tokens=len(prompt_ids), n=n, using_tools=using_tools,
                                   logprobs=logprobs, include_usage=include_usage)


class _ChatChoiceStream:
    """One choice's deltas while streaming (plain text, or the tool answer's pieces)."""

    def __init__(self, index: int, using_tools: bool):
        self.index = index
        self.tools = ToolAnswerStream() if using_tools else None
        self.call_id: str | None = None

    def deltas(self, event: TokenEvent) -> list[dict]:
        if self.tools is None:
            return [{"content": event.text_delta}] if event.text_delta else []
        pieces = self.tools.feed(event.text_delta)
        if event.finish_reason is not None:
            pieces += self.tools.finish()
        out = []
        for piece in pieces:
            if piece.kind == "call":
                self.call_id = new_tool_call_id()
                out.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                            "function": {"name": piece.text, "arguments": ""}}]})
            elif piece.kind == "arguments":
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece.text}}]})
            elif piece.text:
                out.append({"content": piece.text})
        return out

    def finish_reason(self, reason: FinishReason) -> str:
        if self.call_id is not None and reason not in (FinishReason.LENGTH, FinishReason.CONTEXT):
            return "tool_calls"
        return shape.finish_reason(reason)


async def _chat_stream(gen: Generation) -> AsyncIterator[dict | str]:
    p: PreparedChat = gen.context

    def chunk(choice: dict) -> dict:
        return shape.chat_chunk(p.meta, [choice], include_usage=p.include_usage)

    completion_tokens = 0
    choices = [_ChatChoiceStream(i, p.using_tools) for i in range(p.n)]
    for i in range(p.n):
        yield chunk(shape.chat_choice_delta(i, {"role": "assistant", "content": ""}))
    finished = 0
    async for _, event in common.events_of(gen.handles):
        choice = choices[event.index]
        deltas = choice.deltas(event)
        if not deltas and (p.logprobs or event.finish_reason is not None):
            deltas = [{}]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            finish = choice.finish_reason(event.finish_reason) if last and event.finish_reason else None
            yield chunk(shape.chat_choice_delta(event.index, delta, finish=finish,
                                                logprob_events=[event] if p.logprobs and k == 0 else None))
        if event.finish_reason is not None:
            completion_tokens += event.generated_tokens
            finished += 1
    if finished < p.n:
        raise IncompleteGenerationError()
    gen.success(completion_tokens)
    if p.include_usage:
        yield shape.chat_chunk(p.meta, [], include_usage=True,
                               usage_value=shape.usage(p.num_prompt_tokens, completion_tokens))
    yield common.DONE


def _chat_answer(gen: Generation, results: list) -> Response:
    p: PreparedChat = gen.context
    return JSONResponse(shape.chat_completion(p.meta, results[0].sequences, p.num_prompt_tokens,
                                              using_tools=p.using_tools, logprobs=p.logprobs))


async def chat_completions(body: dict) -> Response:
    prepare = functools.partial(_prepare_chat, body)
    if body.get("stream"):
        return await generation.stream(prepare, common.SHAPE, _chat_stream)
    return await generation.generate(prepare, common.SHAPE, _chat_answer)
