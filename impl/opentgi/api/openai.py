"""The OpenAI-compatible routes of TGI's document: `/v1/chat/completions` (operationId
`chat_completions`) and `/v1/completions` (`completions`), re-exported by `opentgi.api.tgi`.

Body (checked against openapi/tgi.json by Connexion) -> generated model -> prompt (chat template,
or FIM) -> one engine request per prompt -> OpenAI JSON or SSE. Everything that can be refused is
refused before the response starts, with a 422/429 in TGI's error shape (so SDKs raise their typed
errors, streaming or not); an error while streaming is one error event, then `data: [DONE]`.

SSE framing: `data:{json}` per chunk as TGI's axum server writes it, and the closing line exactly
`data: [DONE]` (huggingface_hub compares that line byte for byte; the openai SDK takes either).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pydantic
from starlette.responses import JSONResponse, Response

from opentgi.api import openai_shapes as shape
from opentgi.api import runtime
from opentgi.api.chat_template import render_chat
from opentgi.api.errors import IncompleteGenerationError, tgi_error
from opentgi.api.fim import build_fim_prompt_ids
from opentgi.api.openai_params import (
    CHAT_DEFAULT_MAX_TOKENS,
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
from opentgi.api.sse import sse_response
from opentgi.api.tools import ToolAnswerStream, ToolError, new_tool_call_id, select_tools, tool_grammar_schema
from opentgi.engine.errors import GenerationError, OpenTGIError, ValidationError
from opentgi.engine.events import Timings, TokenEvent
from opentgi.engine.request import FinishReason, GenerationRequest, GrammarSpec
from opentgi.schemas.tgi import ChatRequest, CompletionRequest

log = logging.getLogger(__name__)

# sse.sse_event writes "data:" + a str event verbatim: the leading space gives "data: [DONE]".
DONE = " [DONE]"


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:  # the document and the generated model disagree
        first = exc.errors()[0]
        raise ValidationError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from exc


def _limits(state) -> OpenAILimits:
    info = state.engine.info
    vocab = info.vocab_size or len(state.engine.tokenizer)
    return OpenAILimits.from_settings(state.settings, info, vocab)


# --- metrics (this app's opentgi.metrics.Metrics), as TGI records its OpenAI routes ---------------


def _record_start() -> float:
    runtime.metrics().request_started()
    return time.monotonic()


def _record_validated(request: GenerationRequest) -> None:
    runtime.metrics().request_validated(input_length=request.num_prompt_tokens,
                                        max_new_tokens=request.stopping.max_new_tokens)


def _record_failure(exc: BaseException) -> None:
    if isinstance(exc, GenerationError):
        runtime.state().last_success_at = None
    runtime.metrics().request_finished(ok=False, err=tgi_error(exc).error_type)


def _record_success(started_at: float, generated_tokens: int, timings: Timings | None = None) -> None:
    runtime.state().record_success()
    now = time.monotonic()
    durations = {}
    if timings is not None:
        scheduled = timings.scheduled_at if timings.scheduled_at is not None else timings.queued_at
        durations = {"validation_s": max(timings.queued_at - started_at, 0.0),
                     "queue_s": max(scheduled - timings.queued_at, 0.0), "inference_s": max(now - scheduled, 0.0)}
    runtime.metrics().request_finished(ok=True, total_s=now - started_at, generated_tokens=generated_tokens,
                                       **durations)


def _error_response(exc: OpenTGIError) -> Response:
    _record_failure(exc)
    return tgi_error(exc).response()


def _error_event(exc: OpenTGIError) -> dict:
    _record_failure(exc)
    return tgi_error(exc).body


async def _submit_all(engine, requests: list[GenerationRequest]) -> list:
    """Submit every request or none: a refusal cancels the ones already queued."""
    handles = []
    try:
        for request in requests:
            handles.append(await engine.submit(request))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


async def _events_of(handles: list) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(handle index, event) from several handles as they come; cancels them all when closed."""
    if len(handles) == 1:
        try:
            async for event in handles[0]:
                yield 0, event
        finally:
            handles[0].cancel()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle) -> None:
        try:
            async for event in handle:
                queue.put_nowait((i, event, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                remaining -= 1
                continue
            yield i, event
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()


# --- /v1/chat/completions --------------------------------------------------------------------------


@dataclass
class PreparedChat:
    handle: object
    meta: shape.ResponseMeta
    num_prompt_tokens: int
    n: int
    using_tools: bool
    logprobs: bool
    include_usage: bool
    started_at: float = 0.0


def _chat_grammar(body: dict, req: ChatRequest, limits: OpenAILimits) -> tuple[GrammarSpec | None, bool, list]:
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


def _chat_template(engine):
    """The tokenizer's named templates when it has several (so `tool_use` can be picked when tools
    are given), else the engine's resolved template."""
    named = getattr(engine.tokenizer, "chat_template", None)
    return named if isinstance(named, dict) else engine.info.chat_template


def _special_tokens(tokenizer) -> dict[str, str]:
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in tokens.items() if isinstance(v, str)}


async def _prepare_chat(body: dict, started_at: float) -> PreparedChat:
    state = runtime.state()
    engine = state.engine
    limits = _limits(state)
    req = _parse(ChatRequest, body)
    grammar, using_tools, tools = _chat_grammar(body, req, limits)
    n = check_n(req.n, limits)
    check_seed(req.seed, n)
    logprobs = bool(req.logprobs)
    top_logprobs = check_top_logprobs("top_logprobs", req.top_logprobs, limits) if logprobs else 0
    stops = stop_sequences(req.stop, limits)
    sampling = sampling_params(temperature=req.temperature, top_p=req.top_p,
                               frequency_penalty=req.frequency_penalty,
                               presence_penalty=req.presence_penalty, seed=req.seed,
                               logit_bias=body.get("logit_bias"), limits=limits)
    info = engine.info
    text = await asyncio.to_thread(
        render_chat, _chat_template(engine), body["messages"], bos_token=info.bos_token,
        eos_token=info.eos_token, special_tokens=_special_tokens(engine.tokenizer), tools=tools or None,
        tool_prompt=req.tool_prompt)
    prompt_ids = await engine.encode(text, add_special_tokens=False)
    requested = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    budget = max_new_tokens(requested, CHAT_DEFAULT_MAX_TOKENS, len(prompt_ids), limits)
    request = GenerationRequest(prompt_token_ids=prompt_ids, sampling=sampling,
                                stopping=stopping_params(budget, stops), n=n, top_n_tokens=top_logprobs,
                                grammar=grammar)
    _record_validated(request)
    handle = await engine.submit(request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return PreparedChat(handle=handle, meta=shape.ResponseMeta.new("chatcmpl", info.model_id),
                        num_prompt_tokens=len(prompt_ids), n=n, using_tools=using_tools, logprobs=logprobs,
                        include_usage=include_usage, started_at=started_at)


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


async def _chat_stream(p: PreparedChat) -> AsyncIterator[dict | str]:
    def chunk(choice: dict) -> dict:
        return shape.chat_chunk(p.meta, [choice], include_usage=p.include_usage)

    completion_tokens = 0
    try:
        choices = [_ChatChoiceStream(i, p.using_tools) for i in range(p.n)]
        for i in range(p.n):
            yield chunk(shape.chat_choice_delta(i, {"role": "assistant", "content": ""}))
        finished = 0
        async for _, event in _events_of([p.handle]):
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
        _record_success(p.started_at, completion_tokens)
        if p.include_usage:
            yield shape.chat_chunk(p.meta, [], include_usage=True,
                                   usage_value=shape.usage(p.num_prompt_tokens, completion_tokens))
    except OpenTGIError as exc:
        yield _error_event(exc)
    yield DONE


async def chat_completions(body: dict) -> Response:
    started_at = _record_start()
    try:
        prepared = await _prepare_chat(body, started_at)
    except OpenTGIError as exc:
        return _error_response(exc)
    if body.get("stream"):
        return sse_response(_chat_stream(prepared), handle=prepared.handle)
    try:
        result = await prepared.handle.result()
    except OpenTGIError as exc:
        return _error_response(exc)
    finally:
        prepared.handle.cancel()
    _record_success(started_at, sum(s.generated_tokens for s in result.sequences), result.timings)
    return JSONResponse(shape.chat_completion(prepared.meta, result.sequences, prepared.num_prompt_tokens,
                                              using_tools=prepared.using_tools, logprobs=prepared.logprobs))


# --- /v1/completions -------------------------------------------------------------------------------


@dataclass
class PreparedCompletion:
    handles: list
    prompts: list[str]
    prompt_lengths: list[int]
    meta: shape.ResponseMeta
    n: int
    echo: bool
    logprobs: int | None
    include_usage: bool
    started_at: float = 0.0

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.n + seq_index


async def _prompt_ids(engine, settings, prompt: str, suffix: str | None) -> list[int]:
    if suffix is None:
        return await engine.encode(prompt)
    return await asyncio.to_thread(build_fim_prompt_ids, engine.tokenizer, prompt, suffix,
                                   settings.fim_template)


async def _prepare_completion(body: dict, started_at: float) -> PreparedCompletion:
    state = runtime.state()
    engine = state.engine
    limits = _limits(state)
    req = _parse(CompletionRequest, body)
    prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if not prompts:
        raise ValidationError("`prompt` must not be empty")
    if len(prompts) > limits.max_client_batch_size:
        raise ValidationError(f"Number of prompts exceeds the maximum allowed batch size of "
                              f"{limits.max_client_batch_size}")
    n = check_n(req.n, limits)
    check_seed(req.seed, n)
    logprobs = None if req.logprobs is None else check_top_logprobs("logprobs", req.logprobs, limits)
    stops = stop_sequences(req.stop, limits)
    sampling = sampling_params(temperature=req.temperature, top_p=req.top_p,
                               frequency_penalty=req.frequency_penalty,
                               presence_penalty=req.presence_penalty, seed=req.seed,
                               logit_bias=body.get("logit_bias"), limits=limits,
                               repetition_penalty=req.repetition_penalty)
    # The document's default (32) applies when the field is absent; an explicit null means the same.
    requested = body.get("max_tokens")
    default = CompletionRequest.model_fields["max_tokens"].default
    echo = bool(req.echo)
    requests = []
    lengths = []
    for prompt in prompts:
        ids = await _prompt_ids(engine, state.settings, prompt, req.suffix)
        if not ids:
            raise ValidationError("`prompt` must not be empty")
        budget = max_new_tokens(requested, default, len(ids), limits)
        requests.append(GenerationRequest(
            prompt_token_ids=ids, sampling=sampling, stopping=stopping_params(budget, stops), n=n,
            top_n_tokens=logprobs or 0, prompt_logprobs=echo and logprobs is not None))
        lengths.append(len(ids))
    for request in requests:
        _record_validated(request)
    handles = await _submit_all(engine, requests)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return PreparedCompletion(handles=handles, prompts=prompts, prompt_lengths=lengths,
                              meta=shape.ResponseMeta.new("cmpl", engine.info.model_id), n=n, echo=echo,
                              logprobs=logprobs, include_usage=include_usage, started_at=started_at)


def _completion_choices(p: PreparedCompletion, prompt_index: int, result) -> list[dict]:
    prompt = p.prompts[prompt_index]
    choices = []
    for seq in result.sequences:
        logprobs = None
        if p.logprobs is not None:
            builder = shape.CompletionLogprobs(0 if p.echo else len(prompt), with_top=p.logprobs > 0)
            parts = [builder.prompt(result.prefill or [])] if p.echo else []
            logprobs = shape.merge_logprobs(parts + [builder.tokens(seq.tokens)])
        text = prompt + seq.text if p.echo else seq.text
        choices.append(shape.completion_choice(p.choice_index(prompt_index, seq.index), text,
                                               shape.finish_reason(seq.finish_reason), logprobs))
    return choices


async def _completion_stream(p: PreparedCompletion) -> AsyncIterator[dict | str]:
    def chunk(choice: dict) -> dict:
        return shape.completion_chunk(p.meta, [choice], include_usage=p.include_usage)

    try:
        builders = {}
        if p.echo:
            for i, prompt in enumerate(p.prompts):
                for j in range(p.n):
                    yield chunk(shape.completion_choice(p.choice_index(i, j), prompt, None, None))
        completion_tokens = 0
        finished = 0
        async for i, event in _events_of(p.handles):
            index = p.choice_index(i, event.index)
            logprobs = None
            if p.logprobs is not None:
                if index not in builders:
                    builders[index] = shape.CompletionLogprobs(
                        len(p.prompts[i]), with_top=p.logprobs > 0)
                logprobs = builders[index].tokens([event])
            if event.text_delta or event.finish_reason is not None or logprobs is not None:
                yield chunk(shape.completion_choice(index, event.text_delta,
                                                    shape.finish_reason(event.finish_reason), logprobs))
            if event.finish_reason is not None:
                completion_tokens += event.generated_tokens
                finished += 1
        if finished < len(p.handles) * p.n:
            raise IncompleteGenerationError()
        _record_success(p.started_at, completion_tokens)
        if p.include_usage:
            yield shape.completion_chunk(p.meta, [], include_usage=True,
                                         usage_value=shape.usage(sum(p.prompt_lengths), completion_tokens))
    except OpenTGIError as exc:
        yield _error_event(exc)
    yield DONE


async def completions(body: dict) -> Response:
    started_at = _record_start()
    try:
        prepared = await _prepare_completion(body, started_at)
    except OpenTGIError as exc:
        return _error_response(exc)
    if body.get("stream"):
        return sse_response(_completion_stream(prepared))
    try:
        results = await asyncio.gather(*(h.result() for h in prepared.handles))
    except OpenTGIError as exc:
        return _error_response(exc)
    finally:
        for handle in prepared.handles:
            handle.cancel()
    completion_tokens = sum(s.generated_tokens for r in results for s in r.sequences)
    _record_success(started_at, completion_tokens, results[0].timings)
    choices = [c for i, result in enumerate(results) for c in _completion_choices(prepared, i, result)]
    return JSONResponse(shape.completion(prepared.meta, choices,
                                         shape.usage(sum(prepared.prompt_lengths), completion_tokens)))
