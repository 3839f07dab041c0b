"""SenseNova's request semantics: a `CompletionRequest` -> one engine `GenerationRequest`.

The `n` choices share the prompt's KV blocks (one engine request, n sequences). An explicit
`max_new_tokens` must fit the model's context with the prompt (a 422 otherwise); the default (1024)
is not checked: a choice that runs into the context ends with `context`. A choice whose output would
contain a sensitive term (`--sensitive-words`) stops before it with `sensitive`.
"""

from __future__ import annotations

from opentgi.engine.errors import InputTooLongError
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.schemas import sensenova as schema


def check_context(request: schema.CompletionRequest, prompt_tokens: int, max_total_tokens: int) -> None:
    """An explicit `max_new_tokens` must fit: prompt tokens + max_new_tokens <= the model's context."""
    explicit = "max_new_tokens" in request.model_fields_set
    if explicit and prompt_tokens + request.max_new_tokens > max_total_tokens:
        raise InputTooLongError(
            f"prompt tokens ({prompt_tokens}) + max_new_tokens ({request.max_new_tokens}) must be "
            f"<= the model's context length ({max_total_tokens})",
            input_tokens=prompt_tokens,
            max_new_tokens=request.max_new_tokens,
            limit=max_total_tokens,
        )


def generation_request(
    request: schema.CompletionRequest, prompt_token_ids: list[int], sensitive_words: list[str]
) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=prompt_token_ids,
        sampling=SamplingParams(
            do_sample=True,
            temperature=request.temperature,
            top_p=request.top_p,
            repetition_penalty=request.repetition_penalty,
        ),
        stopping=StoppingParams(
            max_new_tokens=request.max_new_tokens,
            stop_sequences=[request.stop] if request.stop else [],
            include_stop_str_in_output=False,
            sensitive_words=list(sensitive_words),
        ),
        n=request.n,
        needs_logprobs=False,  # no SenseNova response shows a logprob
    )
