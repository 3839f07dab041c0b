"""`POST /v1/chat/completions` (operationId `chat_completions`): the OpenAI shape over the shared
chat turn (`opentgi.api.chat`): messages -> prompt, grammar and parsers -> one engine request with
`n` sequences -> an OpenAI `chat.completion` (with `reasoning_content` and native `tool_calls`), or
`chat.completion.chunk` events ending with `data: [DONE]`."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from opentgi.api import generation, runtime
from opentgi.api.adapters import adapter_named_by_model, served_model_name
from opentgi.api.chat import (
    ChatOutputParser,
    ChatTurn,
    PreparedTurn,
    prepare_chat_turn,
    reasoning_budget_for_effort,
)
from opentgi.api.errors import IncompleteGenerationError
from opentgi.api.generation import Generation
from opentgi.api.openai import common
from opentgi.api.openai import shapes as shape
from opentgi.api.openai.params import (
    DEFAULT_MAX_TOKENS,
    check_n,
    check_seed,
    check_top_logprobs,
    max_new_tokens,
    response_format_grammar,
    sampling_params,
    stop_sequences,
    stopping_params,
)
from opentgi.engine.request import GenerationRequest
from opentgi.schemas.tgi import ChatRequest


@dataclass
class PreparedChat:
    meta: shape.ResponseMeta
    turn: PreparedTurn
    num_prompt_tokens: int
    n: int
    logprobs: bool
    include_usage: bool


def chat_turn(body: dict, req: ChatRequest) -> ChatTurn:
    """The request's chat turn (OpenAI chat is the turn's own form)."""
    budget = reasoning_budget_for_effort(body.get("reasoning_effort"))
    parallel = body.get("parallel_tool_calls")
    return ChatTurn(messages=body["messages"], tools=body.get("tools"), tool_choice=body.get("tool_choice"),
                    parallel_tool_calls=True if parallel is None else bool(parallel),
                    response_format=body.get("response_format"),
                    chat_template_kwargs=body.get("chat_template_kwargs"), reasoning_budget=budget,
                    tool_prompt=req.tool_prompt)


async def _prepare_chat(body: dict) -> tuple[list[GenerationRequest], PreparedChat]:
    state = runtime.state()
    engine = state.engine
    limits = common.limits_of(state)
    req = common.parse_model(ChatRequest, body)
    turn = chat_turn(body, req)
    format_grammar = response_format_grammar(turn.response_format, limits)
    n = check_n(req.n, limits)
    check_seed(req.seed, n)
    logprobs = bool(req.logprobs)
    top_logprobs = check_top_logprobs("top_logprobs", req.top_logprobs, limits) if logprobs else 0
    stops = stop_sequences(req.stop, limits)
    sampling = sampling_params(temperature=req.temperature, top_p=req.top_p,
                               frequency_penalty=req.frequency_penalty,
                               presence_penalty=req.presence_penalty, seed=req.seed,
                               logit_bias=body.get("logit_bias"), limits=limits, min_p=req.min_p)
    prepared = await prepare_chat_turn(engine, turn, settings=state.settings,
                                       max_input_tokens=limits.max_input_tokens, format_grammar=format_grammar)
    prompt_ids = prepared.prompt_token_ids
    requested = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    budget = max_new_tokens(requested, DEFAULT_MAX_TOKENS, len(prompt_ids), limits)
    request = GenerationRequest(prompt_token_ids=prompt_ids, sampling=sampling,
                                stopping=stopping_params(budget, stops), n=n, top_n_tokens=top_logprobs,
                                top_n_ties=False,  # OpenAI's top_logprobs: exactly n
                                needs_logprobs=logprobs, grammar=prepared.grammar, reasoning=prepared.reasoning,
                                adapter_id=adapter_named_by_model(engine.info, req.model), images=prepared.images)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    model = served_model_name(engine.info, request.adapter_id)
    return [request], PreparedChat(meta=shape.ResponseMeta.new("chatcmpl", model), turn=prepared,
                                   num_prompt_tokens=len(prompt_ids), n=n, logprobs=logprobs,
                                   include_usage=include_usage)


class _ChatChoiceStream:
    """One choice's deltas while streaming: its parser's pieces as OpenAI deltas."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser

    def deltas(self, event) -> list[dict]:
        pieces = self.parser.feed(event)
        if event.finish_reason is not None:
            pieces += self.parser.finish()
        return [shape.chat_delta(piece) for piece in pieces]

    def finish_reason(self, reason) -> str:
        return shape.chat_finish_reason(reason, self.parser.saw_calls)


async def _chat_stream(gen: Generation) -> AsyncIterator[dict | str]:
    p: PreparedChat = gen.context

    def chunk(choice: dict) -> dict:
        return shape.chat_chunk(p.meta, [choice], include_usage=p.include_usage)

    completion_tokens = 0
    choices = [_ChatChoiceStream(p.turn.make_parser()) for _ in range(p.n)]
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
        cached = await common.cached_tokens(gen.handles)
        yield shape.chat_chunk(p.meta, [], include_usage=True,
                               usage_value=shape.usage(p.num_prompt_tokens, completion_tokens, cached))
    yield common.DONE


def _chat_answer(gen: Generation, results: list) -> Response:
    p: PreparedChat = gen.context
    return JSONResponse(shape.chat_completion(p.meta, results[0].sequences, p.num_prompt_tokens,
                                              make_parser=p.turn.make_parser, logprobs=p.logprobs,
                                              cached_tokens=results[0].num_cached_tokens))


async def chat_completions(body: dict) -> Response:
    prepare = functools.partial(_prepare_chat, body)
    if body.get("stream"):
        return await generation.stream(prepare, common.ERROR_POLICY, _chat_stream)
    return await generation.generate(prepare, common.ERROR_POLICY, _chat_answer)
