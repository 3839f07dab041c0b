"""The model's output as Anthropic content blocks: the shared chat parser's pieces (thinking, text,
tool calls) become `thinking`, `text` and `tool_use` blocks, streamed as Anthropic streams them:

    content_block_start {index, content_block}   a block opens (empty: "", "" or input {})
    content_block_delta {index, delta}           thinking_delta | text_delta | input_json_delta
    content_block_stop  {index}                  before the next block opens, and at the end

and, for a whole message, the same blocks in one list. `stop_reason`: end_turn, max_tokens,
stop_sequence (with the `stop_sequence` that matched) or tool_use.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from opentgi.api.chat import ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart
from opentgi.api.sse import NamedEvent
from opentgi.engine.request import FinishReason

# Anthropic signs its thinking blocks; a server that cannot sign sends the field empty.
NO_SIGNATURE = ""


def stop_reason(reason: FinishReason | None, used_tools: bool) -> str:
    if reason in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "max_tokens"
    if used_tools:
        return "tool_use"
    if reason is FinishReason.STOP_SEQUENCE:
        return "stop_sequence"
    return "end_turn"


def tool_input(arguments: str) -> dict:
    """A tool call's arguments as the `input` object (what the lazy grammar made the model write)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_content(reasoning: str, content: str, tool_calls: Iterable) -> list[dict]:
    """A finished message's blocks: thinking, then text, then one tool_use per call."""
    blocks: list[dict] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": NO_SIGNATURE})
    calls = [{"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}
             for call in tool_calls]
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    return blocks + calls


class BlockStream:
    """Pieces in, Anthropic's content-block events out; one per streamed message."""

    def __init__(self):
        self.index = -1
        self.open_kind: str | None = None  # "thinking" | "text" | "tool_use"
        self.open_tool: int | None = None  # the parser's index of the open tool call
        self.used_tools = False

    def _start(self, kind: str, block: dict) -> list[NamedEvent]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        return [*events, NamedEvent("content_block_start", {"type": "content_block_start", "index": self.index,
                                                            "content_block": block})]

    def _delta(self, delta: dict) -> NamedEvent:
        return NamedEvent("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, piece) -> list[NamedEvent]:
        if isinstance(piece, ReasoningDelta):
            if not piece.text:
                return []
            events = [] if self.open_kind == "thinking" else self._start(
                "thinking", {"type": "thinking", "thinking": "", "signature": NO_SIGNATURE})
            return [*events, self._delta({"type": "thinking_delta", "thinking": piece.text})]
        if isinstance(piece, TextDelta):
            if not piece.text:
                return []
            events = [] if self.open_kind == "text" else self._start("text", {"type": "text", "text": ""})
            return [*events, self._delta({"type": "text_delta", "text": piece.text})]
        if isinstance(piece, ToolCallStart):
            self.used_tools = True
            events = self._start("tool_use", {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            self.open_tool = piece.index
            return events
        if isinstance(piece, ToolCallArguments):
            if not piece.text or self.open_kind != "tool_use" or piece.index != self.open_tool:
                return []
            return [self._delta({"type": "input_json_delta", "partial_json": piece.text})]
        return []

    def finish(self) -> list[NamedEvent]:
        """Closes the last block; a message without any gets one empty text block, as a whole message has."""
        if self.index < 0:
            return [*self._start("text", {"type": "text", "text": ""}), *self.close()]
        return self.close()

    def close(self) -> list[NamedEvent]:
        """Closes the open block, if any."""
        if self.open_kind is None:
            return []
        self.open_kind = self.open_tool = None
        return [NamedEvent("content_block_stop", {"type": "content_block_stop", "index": self.index})]
