"""Engine results -> TGI 2.1's JSON, with TGI's field order and omissions (serde's `skip_serializing_if`).

Logprobs are f32 in TGI: they are written with f32's shortest representation (-0.34, not
-0.3400000035762787), and a non-finite one as null, as serde_json writes it.
"""

from __future__ import annotations

import math

import numpy

from opentgi.engine.events import GenerationResult, PrefillToken, SequenceResult, TokenEvent, TopToken
from opentgi.engine.request import FinishReason

# The engine knows more reasons than TGI's API; each maps to the one a TGI client expects.
FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT: "length",
    FinishReason.EOS_TOKEN: "eos_token",
    FinishReason.GRAMMAR: "eos_token",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.SENSITIVE: "stop_sequence",
}


def logprob(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(str(numpy.float32(value)))


def finish_reason(reason: FinishReason) -> str:
    return FINISH_REASONS[reason]


def token(event: TokenEvent) -> dict:
    return {"id": event.token_id, "text": event.token_text, "logprob": logprob(event.logprob),
            "special": event.special}


def top_token(top: TopToken) -> dict:
    return {"id": top.id, "text": top.text, "logprob": logprob(top.logprob), "special": top.special}


def prefill_token(prefill: PrefillToken) -> dict:
    return {"id": prefill.id, "text": prefill.text, "logprob": logprob(prefill.logprob)}


def best_sequence_index(result: GenerationResult) -> int:
    """TGI's best_of winner: the highest mean token logprob; the first one on a tie."""
    if len(result.sequences) == 1:  # nothing to rank (and no logprobs without best_of or details)
        return 0
    best, best_score = 0, -math.inf
    for i, sequence in enumerate(result.sequences):
        if sequence.mean_logprob > best_score:
            best, best_score = i, sequence.mean_logprob
    return best


def _sequence_fields(sequence: SequenceResult, prefill: list[dict]) -> tuple[dict, list | None]:
    fields = {
        "finish_reason": finish_reason(sequence.finish_reason),
        "generated_tokens": sequence.generated_tokens,
        "seed": sequence.seed,
        "prefill": prefill,
        "tokens": [token(t) for t in sequence.tokens],
    }
    top_tokens = [[top_token(t) for t in (event.top_tokens or [])] for event in sequence.tokens]
    return fields, top_tokens if any(top_tokens) else None


def generate_response(result: GenerationResult, *, details: bool, decoder_input_details: bool,
                      prompt_prefix: str | None) -> dict:
    """`GenerateResponse` of /generate (and each element of POST /'s array)."""
    best = best_sequence_index(result)
    prefix = prompt_prefix or ""
    winner = result.sequences[best]
    body: dict = {"generated_text": prefix + winner.text}
    if not (details or decoder_input_details):
        return body
    prefill = [prefill_token(p) for p in (result.prefill or [])] if decoder_input_details else []
    fields, top_tokens = _sequence_fields(winner, prefill)
    if len(result.sequences) > 1:
        others = []
        for i, sequence in enumerate(result.sequences):
            if i == best:
                continue
            other, other_top = _sequence_fields(sequence, prefill)
            entry = {"generated_text": prefix + sequence.text, **other}
            if other_top is not None:
                entry["top_tokens"] = other_top
            others.append(entry)
        fields["best_of_sequences"] = others
    if top_tokens is not None:
        fields["top_tokens"] = top_tokens
    body["details"] = fields
    return body


def stream_response(index: int, event: TokenEvent, *, generated_text: str | None = None,
                    details: dict | None = None) -> dict:
    """One /generate_stream event (`StreamResponse`): index counts tokens from 1."""
    body: dict = {"index": index, "token": token(event)}
    if event.top_tokens:
        body["top_tokens"] = [top_token(t) for t in event.top_tokens]
    body["generated_text"] = generated_text
    body["details"] = details
    return body


def stream_details(sequence: SequenceResult) -> dict:
    return {"finish_reason": finish_reason(sequence.finish_reason),
            "generated_tokens": sequence.generated_tokens, "seed": sequence.seed}


def tokenize_response(inputs: str, token_ids: list[int], char_offsets: list[tuple[int, int]]) -> list[dict]:
    """/tokenize: TGI's `SimpleToken`s. `start`/`stop` are UTF-8 byte offsets into `inputs`, as the
    Rust tokenizer reports them to TGI (Python's fast tokenizer reports character offsets), and
    `text` is exactly those bytes of the input."""
    byte_at = [0]
    for char in inputs:
        byte_at.append(byte_at[-1] + len(char.encode("utf-8")))
    return [{"id": i, "text": inputs[start:stop], "start": byte_at[start], "stop": byte_at[stop]}
            for i, (start, stop) in zip(token_ids, char_offsets, strict=True)]
