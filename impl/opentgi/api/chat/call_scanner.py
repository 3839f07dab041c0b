"""Tool calls read from JSON text as it is generated: `{"name": "f", "arguments": {...}}` (or a
JSON array of them), giving each call's name as soon as it is complete and its arguments in
fragments that concatenate to the arguments' JSON text.

A character scanner follows strings and nesting depth, so it knows exactly where the arguments
value ends (no closing brace is ever handed out as arguments). A call whose keys come in another
order (no grammar held the model to ours) is parsed whole when its object closes.
"""

from __future__ import annotations

import json
import re
import uuid

from opentgi.api.chat.turn_output import ChatPiece, ToolCallArguments, ToolCallStart

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallScanner:
    """One tool-call section. `array`: the calls are a JSON array (`[{...}, {...}]`). Call indexes
    start at `first_index`; `done` is True once the section's JSON value is complete."""

    def __init__(self, *, array: bool, first_index: int = 0):
        self.base = 1 if array else 0  # depth at which a call object opens
        self.next_index = first_index
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._obj: str | None = None  # the current call object's text so far
        self._call: int | None = None  # index of the current call once its head was read
        self._args = "off"  # "off" | "before" (whitespace) | "compound" | "primitive" | "ended"

    def feed(self, text: str) -> list[ChatPiece]:
        out: list[ChatPiece] = []
        args: list[str] = []
        for ch in text:
            if self.done:
                break
            self._char(ch, out, args)
        if args and self._call is not None:
            out.append(ToolCallArguments(self._call, "".join(args)))
        return out

    def _char(self, ch: str, out: list[ChatPiece], args: list[str]) -> None:
        depth_before = self._depth
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            if ch == "{" and self._depth == self.base and self._obj is None:
                self._obj, self._call, self._args = "", None, "off"
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
        if self._obj is None:
            if self._depth == 0 and depth_before > 0 or (self.base == 0 and ch not in " \t\r\n{"):
                self.done = self._depth == 0
            return
        self._obj += ch
        if self._args == "off":
            head = _HEAD.match(self._obj)
            if head:
                self._call = self.next_index
                self.next_index += 1
                out.append(ToolCallStart(self._call, new_tool_call_id(), json.loads(f'"{head.group(1)}"')))
                self._args = "before"
        elif self._args == "before" and not ch.isspace():
            self._args = "compound" if ch in "{[" else "primitive"
        if self._args == "compound":
            args.append(ch)
            if self._depth == self.base + 1 and not self._in_string and ch in "}]":
                self._args = "ended"
        elif self._args == "primitive":
            if not self._in_string and self._depth <= self.base + 1 and ch in ",}" and depth_before == self.base + 1:
                self._args = "ended"
            else:
                args.append(ch)
        if self._depth == self.base and depth_before == self.base + 1:  # the call object closed
            self._close(out, args)
            if self.base == 0:
                self.done = True

    def _close(self, out: list[ChatPiece], args: list[str]) -> None:
        obj, self._obj = self._obj, None
        if self._call is not None:
            if args:
                out.append(ToolCallArguments(self._call, "".join(args)))
                args.clear()
            self._call = None
            return
        try:  # keys in another order: the whole object at once
            value = json.loads(obj)
        except json.JSONDecodeError:
            return
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = value.get("arguments", value.get("parameters", {}))
            index = self.next_index
            self.next_index += 1
            out.append(ToolCallStart(index, new_tool_call_id(), value["name"]))
            out.append(ToolCallArguments(index, json.dumps(arguments, ensure_ascii=False)))
