"""`POST /v1/completions` (operationId `completions`): one engine request per prompt (a string or
a list; with `suffix`, a fill-in-the-middle prompt), `n` sequences each -> an OpenAI
`text_completion`, or chunks ending with `data: [DONE]`. Choice index = prompt index x n + i."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from opentgi.api import generation, runtime
from opentgi.api.adapters import adapter_named_by_model, served_model_name
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
    sampling_params,
    stop_sequences,
    stopping_params,
)
from opentgi.engine.errors import ValidationError
from opentgi.engine.request import GenerationRequest
from opentgi.schemas.tgi import CompletionRequest


@dataclass
class PreparedCompletion:
    prompts: list[str]
    prompt_lengths: list[int]
    meta: shape.ResponseMeta
    n: int
    echo: bool
    logprobs: int | None
    include_usage: bool

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.n + seq_index


async def _prompt_ids(engine, settings, prompt: str, suffix: str | None) -> list[int]:
    if suffix is None:
        return await engine.encode(prompt, max_tokens=engine.info.max_input_tokens)
    return await engine.encode_fim(prompt, suffix, settings.fim_template)


async def _prepare_completion(body: dict) -> tuple[list[GenerationRequest], PreparedCompletion]:
    state = runtime.state()
    engine = state.engine
    limits = common.limits_of(state)
    req = common.parse_model(CompletionRequest, body)
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
                               repetition_penalty=req.repetition_penalty, min_p=req.min_p)
    # Absent or null: TGI's default (100, capped to what fits); the model's 32 is the document's.
    requested = body.get("max_tokens")
    echo = bool(req.echo)
    adapter = adapter_named_by_model(engine.info, req.model)  # else the base model
    requests = []
    lengths = []
    for prompt in prompts:
        ids = await _prompt_ids(engine, state.settings, prompt, req.suffix)
        if not ids:
            raise ValidationError("`prompt` must not be empty")
        budget = max_new_tokens(requested, DEFAULT_MAX_TOKENS, len(ids), limits)
        requests.append(GenerationRequest(
            prompt_token_ids=ids, sampling=sampling, stopping=stopping_params(budget, stops), n=n,
            top_n_tokens=logprobs or 0, top_n_ties=False,  # OpenAI's logprobs: exactly n
            prompt_logprobs=echo and logprobs is not None,  # the echoed prompt's logprobs
            needs_logprobs=logprobs is not None,  # `logprobs: 0` still shows token_logprobs
            adapter_id=adapter))
        lengths.append(len(ids))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return requests, PreparedCompletion(prompts=prompts, prompt_lengths=lengths,
                                        meta=shape.ResponseMeta.new("cmpl", served_model_name(engine.info, adapter)), n=n,
                                        echo=echo, logprobs=logprobs, include_usage=include_usage)


def _echo_logprobs(builder: shape.CompletionLogprobs, result) -> dict:
    """The echoed prompt's logprobs (the first token has none); advances the builder's offset."""
    return builder.prompt(result.prefill or [])


def _completion_choices(p: PreparedCompletion, prompt_index: int, result) -> list[dict]:
    prompt = p.prompts[prompt_index]
    choices = []
    for seq in result.sequences:
        logprobs = None
        if p.logprobs is not None:
            builder = shape.CompletionLogprobs(0 if p.echo else len(prompt), with_top=p.logprobs > 0)
            parts = [_echo_logprobs(builder, result)] if p.echo else []
            logprobs = shape.merge_logprobs(parts + [builder.tokens(seq.tokens)])
        text = prompt + seq.text if p.echo else seq.text
        choices.append(shape.completion_choice(p.choice_index(prompt_index, seq.index), text,
                                               shape.finish_reason(seq.finish_reason), logprobs))
    return choices


async def _completion_stream(gen: Generation) -> AsyncIterator[dict | str]:
    """With `echo`, each choice starts with its prompt. The prompt's logprobs come with the engine's
    final result, so with `echo` and `logprobs` a prompt's chunks are held until its sequences end."""
    p: PreparedCompletion = gen.context

    def chunk(choice: dict) -> dict:
        return shape.completion_chunk(p.meta, [choice], include_usage=p.include_usage)

    def echo_chunks(i: int, logprobs: dict | None) -> list[dict]:
        return [chunk(shape.completion_choice(p.choice_index(i, j), p.prompts[i], None, logprobs))
                for j in range(p.n)]

    hold = p.echo and p.logprobs is not None
    held: dict[int, list[dict]] = {i: [] for i in range(len(p.prompts))}
    finished_of: dict[int, int] = dict.fromkeys(held, 0)
    builders = {}
    if p.echo and not hold:
        for i in range(len(p.prompts)):
            for echoed in echo_chunks(i, None):
                yield echoed
    completion_tokens = 0
    finished = 0
    async for i, event in common.events_of(gen.handles):
        index = p.choice_index(i, event.index)
        logprobs = None
        if p.logprobs is not None:
            if index not in builders:
                builders[index] = shape.CompletionLogprobs(
                    len(p.prompts[i]), with_top=p.logprobs > 0)
            logprobs = builders[index].tokens([event])
        if event.text_delta or event.finish_reason is not None or logprobs is not None:
            out = chunk(shape.completion_choice(index, event.text_delta,
                                                shape.finish_reason(event.finish_reason), logprobs))
            if hold:
                held[i].append(out)
            else:
                yield out
        if event.finish_reason is not None:
            completion_tokens += event.generated_tokens
            finished += 1
            finished_of[i] += 1
            if hold and finished_of[i] == p.n:  # the result (with the prompt's logprobs) is in
                result = await gen.handles[i].result()
                echoed = _echo_logprobs(shape.CompletionLogprobs(0, with_top=p.logprobs > 0), result)
                for out in echo_chunks(i, echoed) + held.pop(i):
                    yield out
    if finished < len(gen.handles) * p.n:
        raise IncompleteGenerationError()
    gen.success(completion_tokens)
    if p.include_usage:
        cached = await common.cached_tokens(gen.handles)
        yield shape.completion_chunk(p.meta, [], include_usage=True,
                                     usage_value=shape.usage(sum(p.prompt_lengths), completion_tokens, cached))
    yield common.DONE


def _completion_answer(gen: Generation, results: list) -> Response:
    p: PreparedCompletion = gen.context
    completion_tokens = sum(s.generated_tokens for r in results for s in r.sequences)
    choices = [c for i, result in enumerate(results) for c in _completion_choices(p, i, result)]
    cached = sum(r.num_cached_tokens for r in results)
    return JSONResponse(shape.completion(p.meta, choices, shape.usage(sum(p.prompt_lengths), completion_tokens,
                                                                      cached)))


def _completion_tokens(results: list) -> int:
    return sum(s.generated_tokens for r in results for s in r.sequences)


async def completions(body: dict) -> Response:
    prepare = functools.partial(_prepare_completion, body)
    if body.get("stream"):
        return await generation.stream(prepare, common.ERROR_POLICY, _completion_stream)
    return await generation.generate(prepare, common.ERROR_POLICY, _completion_answer,
                                     generated_tokens=_completion_tokens)
