"""TGI's tool contract (a client sends `tool_prompt`, or the template has no tool-call format of
its own): the model answers one JSON object from its first token, constrained by a grammar:

- a call: `{"name": "<function>", "arguments": {...}}`, arguments validated by the function's
  `parameters` schema;
- with `tool_choice: "auto"` only, the no-tool answer `{"content": "<text>"}`, returned as an
  ordinary assistant message (TGI's `notify_error`/`no_tool` idea, without a reserved function name
  that could collide with the user's).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from opentgi.api.chat.tools import ToolSelection, call_schema


def tool_grammar_schema(selection: ToolSelection) -> dict:
    """The JSON schema every answer of this request must satisfy."""
    schema = call_schema(selection)
    if selection.mode != "auto":
        return schema
    text = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
            "additionalProperties": False}
    defs = {k: v for k, v in schema.items() if k in ("$defs", "definitions")}
    calls = [v for k, v in schema.items() if k == "anyOf"] or [None]
    alternatives = calls[0] if calls[0] is not None else \
        [{k: v for k, v in schema.items() if k not in defs}]
    return {"anyOf": [*alternatives, text], **defs}


@dataclass
class ParsedToolAnswer:
    """The model's constrained answer: a call (name + arguments as a JSON string) or text."""

    name: str | None = None
    arguments: str | None = None
    content: str | None = None

    @property
    def is_call(self) -> bool:
        return self.name is not None


def parse_tool_answer(text: str) -> ParsedToolAnswer | None:
    """Parse a complete answer; None when it is not a valid answer (cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("name"), str) and "arguments" in value:
        return ParsedToolAnswer(name=value["name"],
                                arguments=json.dumps(value["arguments"], ensure_ascii=False))
    if isinstance(value.get("content"), str):
        return ParsedToolAnswer(content=value["content"])
    return None


# ------------------------------------------------------------------------------------------------
# Streaming: turn the answer's text, as it is generated, into OpenAI deltas.

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TEXT_HEAD = re.compile(r'\s*\{\s*"content"\s*:\s*"')
_CALL_TAIL = re.compile(r"\s*\}?\s*$")  # what may still be the outer object's closing brace
_FINAL_TAIL = re.compile(r"\s*\}\s*$")


@dataclass
class ToolDelta:
    kind: str  # "call" (a call starts: name) | "arguments" (a piece of arguments) | "content"
    text: str


def _safe_string_prefix(raw: str) -> tuple[int, bool]:
    """How much of a JSON string body (after the opening quote) can be decoded now, and whether
    the closing quote was reached. Escapes are never split."""
    i, n = 0, len(raw)
    while i < n:
        ch = raw[i]
        if ch == '"':
            return i, True
        if ch == "\\":
            if i + 1 >= n:
                break
            if raw[i + 1] == "u":
                if i + 6 > n:
                    break
                code = int(raw[i + 2:i + 6], 16)
                if 0xD800 <= code < 0xDC00:  # a surrogate pair: wait for the low half
                    if i + 12 > n:
                        break
                    i += 12
                    continue
                i += 6
                continue
            i += 2
            continue
        i += 1
    return i, False


class ToolAnswerStream:
    """Incremental parser of the constrained answer. `feed(text)` returns what can be shown now;
    `finish()` releases the rest. Argument pieces concatenate to valid JSON."""

    def __init__(self) -> None:
        self.raw = ""
        self.mode: str | None = None  # None (undecided) | "call" | "text" | "done"
        self._start = 0  # where the arguments value / string body starts in raw
        self._emitted = 0  # raw characters (from _start) already handed out

    def feed(self, text: str) -> list[ToolDelta]:
        self.raw += text
        out: list[ToolDelta] = []
        if self.mode is None:
            call = _CALL_HEAD.match(self.raw)
            if call:
                self.mode, self._start = "call", call.end()
                out.append(ToolDelta("call", json.loads(f'"{call.group(1)}"')))
            else:
                head = _TEXT_HEAD.match(self.raw)
                if head:
                    self.mode, self._start = "text", head.end()
        if self.mode == "call":
            if self._emitted == 0:  # whitespace before the arguments value is no part of it
                body = self.raw[self._start:]
                self._start += len(body) - len(body.lstrip())
            body = self.raw[self._start:]
            tail = _CALL_TAIL.search(body)
            keep = tail.start() if tail else len(body)
            if keep > self._emitted:
                out.append(ToolDelta("arguments", body[self._emitted:keep]))
                self._emitted = keep
        elif self.mode == "text":
            body = self.raw[self._start:]
            end, closed = _safe_string_prefix(body)
            if end > self._emitted:
                out.append(ToolDelta("content", json.loads(f'"{body[self._emitted:end]}"')))
                self._emitted = end
            if closed:
                self.mode = "done"
        return out

    def finish(self) -> list[ToolDelta]:
        """The generation ended: hand out what was held back (never the outer closing brace)."""
        out: list[ToolDelta] = []
        if self.mode == "call":
            body = self.raw[self._start:]
            tail = _FINAL_TAIL.search(body)
            end = tail.start() if tail else len(body.rstrip())
            if end > self._emitted:
                out.append(ToolDelta("arguments", body[self._emitted:end]))
                self._emitted = end
        elif self.mode is None:
            parsed = parse_tool_answer(self.raw)  # a key order the head patterns did not expect
            if parsed and parsed.is_call:
                out += [ToolDelta("call", parsed.name), ToolDelta("arguments", parsed.arguments)]
            elif parsed:
                out.append(ToolDelta("content", parsed.content))
            elif self.raw:  # cut short before a call or a text began: show what there is
                out.append(ToolDelta("content", self.raw))
            self.mode = "done"
        return out
