"""The model's output as OpenAI Responses stream events, each numbered (`sequence_number`) and named
(`event: TYPE`). Per output item, as OpenAI sends them:

    reasoning      output_item.added, content_part.added (reasoning_text), reasoning_text.delta ...,
                   reasoning_text.done, content_part.done, output_item.done
    message        output_item.added, content_part.added (output_text), output_text.delta ...,
                   output_text.done, content_part.done, output_item.done
    function_call  output_item.added, function_call_arguments.delta ..., function_call_arguments.done,
                   output_item.done

framed by response.created and response.in_progress first and response.completed (or
response.incomplete, when max_output_tokens ran out) last.
"""

from __future__ import annotations

import itertools

from opentgi.api.chat import ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart
from opentgi.api.responses import output as shapes
from opentgi.api.sse import NamedEvent


class ResponseEvents:
    """Numbers the events of one response and turns the chat parser's pieces into output items."""

    def __init__(self, meta: shapes.ResponseMeta):
        self.meta = meta
        self.sequence = itertools.count()
        self.items: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being written
        self.open_text = ""
        self.open_tool: int | None = None  # the parser's index of the open function call

    def event(self, kind: str, **fields) -> NamedEvent:
        return NamedEvent(kind, {"type": kind, "sequence_number": next(self.sequence), **fields})

    def lifecycle(self, kind: str, status: str, usage: dict | None = None) -> NamedEvent:
        return self.event(kind, response=shapes.response_object(self.meta, status, list(self.items), usage))

    def start(self) -> list[NamedEvent]:
        return [self.lifecycle("response.created", "in_progress"), self.lifecycle("response.in_progress", "in_progress")]

    def _where(self) -> dict:
        return {"output_index": len(self.items), "item_id": self.open["id"]}

    def _open(self, item: dict, part: dict | None) -> list[NamedEvent]:
        events = self.close()
        self.open, self.open_text = item, ""
        events.append(self.event("response.output_item.added", output_index=len(self.items), item=dict(item)))
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def feed(self, piece) -> list[NamedEvent]:
        kind = self.open["type"] if self.open else None
        if isinstance(piece, ReasoningDelta) and piece.text:
            events = [] if kind == "reasoning" else self._open(
                shapes.reasoning_item(shapes.new_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""})
            self.open_text += piece.text
            return [*events, self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                        delta=piece.text)]
        if isinstance(piece, TextDelta) and piece.text:
            events = [] if kind == "message" else self._open(
                shapes.message_item(shapes.new_id("msg"), None, "in_progress"), shapes.output_text(""))
            self.open_text += piece.text
            return [*events, self.event("response.output_text.delta", **self._where(), content_index=0,
                                        delta=piece.text, logprobs=[])]
        if isinstance(piece, ToolCallStart):
            events = self._open(shapes.function_call_item(shapes.new_id("fc"), piece.id, piece.name, "",
                                                          "in_progress"), None)
            self.open_tool = piece.index
            return events
        if isinstance(piece, ToolCallArguments) and piece.text and kind == "function_call" \
                and self.open_tool == piece.index:
            self.open_text += piece.text
            return [self.event("response.function_call_arguments.delta", **self._where(), delta=piece.text)]
        return []

    def close(self, status: str = "completed") -> list[NamedEvent]:
        """Finishes the open item (its done events) and adds it to the output."""
        if self.open is None:
            return []
        item, text, where = self.open, self.open_text, self._where()
        events = []
        if item["type"] == "reasoning":
            done = shapes.reasoning_item(item["id"], text, status)
            part = {"type": "reasoning_text", "text": text}
            events += [self.event("response.reasoning_text.done", **where, content_index=0, text=text),
                       self.event("response.content_part.done", **where, content_index=0, part=part)]
        elif item["type"] == "message":
            done = shapes.message_item(item["id"], text, status)
            events += [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0,
                                  part=shapes.output_text(text))]
        else:
            done = shapes.function_call_item(item["id"], item["call_id"], item["name"], text, status)
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=text))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=done))
        self.items.append(done)
        self.open, self.open_text = None, ""
        return events

    def finish(self, incomplete: bool, usage: dict) -> list[NamedEvent]:
        """The last item's done events (an empty message when nothing was written) and the final
        response.completed / response.incomplete."""
        status = "incomplete" if incomplete else "completed"
        events = []
        if self.open is None and not self.items:
            events += self._open(shapes.message_item(shapes.new_id("msg"), None, "in_progress"),
                                 shapes.output_text(""))
        events += self.close(status)
        events.append(self.lifecycle(f"response.{status}", status, usage))
        return events
