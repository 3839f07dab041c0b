"""What a handler asks of the engine: one engine-neutral request, built by a dialect's handler."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

# the image fields' types, defined beside the model code that reads them
from opentgi.models.vision.inputs import ImageData, ImageInput  # noqa: F401

_request_ids = itertools.count()


class FinishReason(str, Enum):
    LENGTH = "length"  # max_new_tokens generated
    EOS_TOKEN = "eos_token"  # the model's end-of-sequence token (or a stop token id)
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched
    CONTEXT = "context"  # the sequence filled the context window (max_total_tokens) first
    SENSITIVE = "sensitive"  # a sensitive word would have been emitted (SenseNova)
    GRAMMAR = "grammar"  # the grammar accepts no further token (output complete)


@dataclass
class SamplingParams:
    """Per-sequence sampling parameters; the sampler holds them as per-row tensors of the batch."""

    do_sample: bool = False  # False: greedy (argmax), the warpers below are ignored
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off; tokens below min_p x the likeliest token's probability are left out
    typical_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # HF/TGI style: divides positive logits of seen tokens
    frequency_penalty: float = 0.0  # OpenAI style: logit -= penalty * count(token in output)
    presence_penalty: float = 0.0  # OpenAI style: logit -= penalty if token in output
    seed: int | None = None  # sequence i of a request uses seed + i; None = a random seed each
    watermark: bool = False  # Kirchenbauer soft watermark (gamma/delta from Settings)
    logit_bias: dict[int, float] | None = None  # token id -> bias added to the logit


@dataclass
class StoppingParams:
    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    # TGI keeps a matched stop string in the output; OpenAI routes drop it (and hold back text that
    # could still become one while streaming).
    include_stop_str_in_output: bool = True
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the sequence
    # Never emitted; generation stops before them with FinishReason.SENSITIVE.
    sensitive_words: list[str] = field(default_factory=list)


@dataclass
class GrammarSpec:
    """A constraint on the output, compiled by `opentgi.engine.sampling.grammar` off the engine loop."""

    type: str  # "json" (value: a JSON schema as text) | "regex" (value: a regular expression)
    value: str
    # Lazy grammar (native tool calls): the output is free until one of these token sequences has
    # been generated; the grammar then constrains what follows. Empty: constrained from the start
    # (after the reasoning, when the request has a ReasoningSpec).
    trigger_token_ids: list[list[int]] = field(default_factory=list)
    force_trigger: bool = False  # write the first trigger at once (a call is required)
    # The output may also open with the grammar itself (Llama 3.1 writes a call as bare JSON): a
    # first token the grammar accepts starts it.
    trigger_at_start: bool = False
    end_token_ids: list[int] = field(default_factory=list)  # forced once the grammar is complete
    # After the grammar (and end_token_ids) completed: False ends the sequence, True waits for the
    # next trigger (several tool calls).
    repeat: bool = False


@dataclass
class ReasoningSpec:
    """The model's thinking span (`<think>` ... `</think>` as token ids). A grammar waits until the
    span is closed; a budget closes it by forcing `end_token_ids` after that many thinking tokens."""

    start_token_ids: list[int]
    end_token_ids: list[int]
    starts_open: bool = False  # the prompt already opened the span (the template wrote `<think>`)
    budget: int | None = None  # thinking tokens allowed before the end marker is forced


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    n: int = 1  # sequences sampled from this prompt; they share the prompt's KV blocks
    top_n_tokens: int = 0  # per generated token, the n most likely alternatives (ties in token-id order)
    top_n_ties: bool = True  # also every token tied with the n-th (TGI); False: exactly n (OpenAI)
    prompt_logprobs: bool = False  # logprobs of every prompt token (TGI decoder_input_details)
    # Whether the generated tokens' logprobs, or anything derived from them (best_of ranking,
    # mean logprob), reach the client. False: the sampler may skip the log-softmax, and the
    # events' `logprob` is None. A handler sets it False only where its response shows none.
    needs_logprobs: bool = True
    grammar: GrammarSpec | None = None
    reasoning: ReasoningSpec | None = None  # the thinking span a grammar waits for / a budget closes
    score: bool = False  # reward model: one prefill pass, result.score, no tokens generated
    adapter_id: str | None = None  # a LoRA adapter loaded at start-up (--lora-adapters); None = base
    images: list[ImageInput] = field(default_factory=list)  # in prompt order (vision-language models)
    # Who asks (--tenants): the scheduler shares the batch between tenants by weight
    # (engine/scheduling/fair_share.py). None: no tenant, first-come with every other such request.
    tenant: str | None = None
    tenant_weight: float = 1.0
    request_id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
