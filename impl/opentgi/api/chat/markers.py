"""The special tokens a chat turn is split on, found once per model from its template and
tokenizer: the think markers (`<think>` / `</think>`) and the tool-call format's markers.

Think markers count only when the template writes one of them (a template that never thinks has
none, whatever the vocabulary holds) and each is one token. Whether the prompt already opened the
thinking (Qwen3-Thinking and DeepSeek-R1 templates end the generation prompt with `<think>\\n`) is
read from the prompt's token ids: its last marker is `<think>` (or `</think>`, when the template
wrote this turn's thinking itself, an empty one to turn thinking off).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from opentgi.api.chat.tool_formats import FORMATS, NO_PARSER, ToolCallTokens, detect_format

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ThinkTokens:
    start_id: int
    end_id: int

    def prompt_state(self, prompt_ids: list[int]) -> str:
        """"open": the prompt ends inside a thinking span (the model continues it); "closed": the
        template already wrote the span of this turn (Qwen3 with `enable_thinking=false` writes an
        empty one), the model answers; "none": the model may open one with its first token."""
        for token in reversed(prompt_ids):
            if token == self.start_id:
                return "open"
            if token == self.end_id:
                return "closed"
        return "none"


@dataclass(frozen=True)
class ChatMarkers:
    think: ThinkTokens | None
    tool_calls: ToolCallTokens | None


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {key: ChatMarkers}


async def _single_token(engine, text: str) -> int | None:
    ids = await engine.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


async def find_markers(engine, template_source: str, tool_call_parser: str | None = None) -> ChatMarkers:
    """The markers of this engine's model for `template_source`; `tool_call_parser` names a format
    (or "none") instead of detecting it. Cached per engine."""
    per_engine = _cache.setdefault(engine, {})
    key = (template_source, tool_call_parser)
    found = per_engine.get(key)
    if found is not None:
        return found
    think = None
    if THINK_START in template_source or THINK_END in template_source:
        start, end = await _single_token(engine, THINK_START), await _single_token(engine, THINK_END)
        if start is not None and end is not None:
            think = ThinkTokens(start, end)
    if tool_call_parser == NO_PARSER:
        fmt = None
    elif tool_call_parser:
        fmt = FORMATS[tool_call_parser]
    else:
        fmt = detect_format(template_source)
    tools = None
    if fmt is not None:
        opener = await _single_token(engine, fmt.opener)
        closer = await _single_token(engine, fmt.closer) if fmt.closer else None
        if opener is not None and (fmt.closer is None or closer is not None):
            tools = ToolCallTokens(fmt, opener, closer)
    found = per_engine[key] = ChatMarkers(think, tools)
    return found
