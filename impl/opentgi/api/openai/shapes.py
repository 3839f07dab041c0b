"""Engine results -> the OpenAI response objects of `/v1/chat/completions` and `/v1/completions`.

Shapes are OpenAI's (which TGI's document describes, with the fields TGI 2.1 leaves out added to
openapi/tgi.json): `object`, `finish_reason` in stop/length/tool_calls/content_filter, tool call
`arguments` as a JSON string, chat `logprobs.content[]`, completion `logprobs` with `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import opentgi
from opentgi.api.chat import (
    ChatPiece,
    ReasoningDelta,
    TextDelta,
    ToolCallStart,
    new_tool_call_id,
    parse_sequence,
)
from opentgi.engine.events import PrefillToken, SequenceResult, TokenEvent, TopToken
from opentgi.engine.request import FinishReason

SYSTEM_FINGERPRINT = f"{opentgi.__version__}-native"  # TGI: "{version}-{docker_label or native}"

_FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT: "length",
    FinishReason.EOS_TOKEN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.GRAMMAR: "stop",
    FinishReason.SENSITIVE: "content_filter",
}


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH[reason]


@dataclass(frozen=True)
class ResponseMeta:
    """What every object (or chunk) of one response shares."""

    id: str
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseMeta:
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model)

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's prompt_tokens_details, where the route knows it
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


# --- chat ----------------------------------------------------------------------------------------

def chat_logprob(event: TokenEvent) -> dict:
    return {"token": event.token_text, "logprob": event.logprob,
            "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in event.top_tokens or []]}


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def chat_finish_reason(reason: FinishReason | None, called_tools: bool) -> str | None:
    """A turn that called tools ends with "tool_calls", unless it was cut short."""
    if called_tools and reason not in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "tool_calls"
    return finish_reason(reason)


def chat_delta(piece: ChatPiece) -> dict:
    """One streamed piece as an OpenAI chat delta (reasoning as vLLM's `reasoning_content`)."""
    if isinstance(piece, ReasoningDelta):
        return {"reasoning_content": piece.text}
    if isinstance(piece, TextDelta):
        return {"content": piece.text}
    if isinstance(piece, ToolCallStart):
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                "function": {"name": piece.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}


def chat_message(seq: SequenceResult, parser) -> tuple[dict, str]:
    """The assistant message of one choice (its events through `parser`) and its finish_reason."""
    parsed = parse_sequence(seq, parser)
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["content"] = parsed.content or None
        message["tool_calls"] = [tool_call(c.name, c.arguments, c.id) for c in parsed.tool_calls]
    return message, chat_finish_reason(seq.finish_reason, bool(parsed.tool_calls))


def chat_completion(meta: ResponseMeta, sequences: list[SequenceResult], prompt_tokens: int, *,
                    make_parser, logprobs: bool, cached_tokens: int | None = None) -> dict:
    choices = []
    for seq in sorted(sequences, key=lambda s: s.index):
        message, reason = chat_message(seq, make_parser())
        choices.append({
            "index": seq.index, "message": message,
            "logprobs": {"content": [chat_logprob(t) for t in seq.tokens]} if logprobs else None,
            "finish_reason": reason,
        })
    completion_tokens = sum(s.generated_tokens for s in sequences)
    return {**meta.head("chat.completion"), "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chat_chunk(meta: ResponseMeta, choices: list[dict], *, include_usage: bool, usage_value=None) -> dict:
    chunk = {**meta.head("chat.completion.chunk"), "choices": choices}
    if include_usage:  # OpenAI: null on every chunk but the last one
        chunk["usage"] = usage_value
    return chunk


def chat_choice_delta(index: int, delta: dict, *, finish: str | None = None,
                      logprob_events: list[TokenEvent] | None = None) -> dict:
    return {"index": index, "delta": delta,
            "logprobs": None if logprob_events is None else {"content": [chat_logprob(e) for e in logprob_events]},
            "finish_reason": finish}


# --- completions ---------------------------------------------------------------------------------

def _top_map(top: list[TopToken] | None) -> dict[str, float] | None:
    if top is None:
        return None
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t.text, t.logprob)  # several ids may decode to one text: keep the likeliest
    return out


class CompletionLogprobs:
    """OpenAI's legacy completion logprobs, built token by token (text_offset counts characters of
    the choice's text, echoed prompt included)."""

    def __init__(self, text_offset: int = 0, with_top: bool = True):
        self.offset = text_offset
        self.with_top = with_top

    def _entry(self, text: str, logprob: float | None, top: list[TopToken] | None) -> dict:
        entry = {"tokens": [text], "token_logprobs": [logprob],
                 "top_logprobs": [_top_map(top) if self.with_top else None], "text_offset": [self.offset]}
        self.offset += len(text)
        return entry

    def prompt(self, prefill: list[PrefillToken]) -> dict:
        return merge_logprobs([self._entry(t.text, t.logprob, None) for t in prefill])

    def tokens(self, events: list[TokenEvent]) -> dict:
        return merge_logprobs([self._entry(e.token_text, e.logprob, e.top_tokens) for e in events])


def merge_logprobs(parts: list[dict]) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in out.items():
            values.extend(part[key])
    return out


def completion_choice(index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def completion(meta: ResponseMeta, choices: list[dict], usage_value: dict) -> dict:
    return {**meta.head("text_completion"), "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": usage_value}


def completion_chunk(meta: ResponseMeta, choices: list[dict], *, include_usage: bool, usage_value=None) -> dict:
    chunk = {**meta.head("text_completion"), "choices": choices}
    if include_usage:
        chunk["usage"] = usage_value
    return chunk
