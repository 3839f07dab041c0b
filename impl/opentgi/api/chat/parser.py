"""One generated sequence's tokens -> chat pieces: thinking, answer text and tool calls.

The parser switches on token ids (the think markers, a tool-call format's opener and closer), not
on text, so a user who writes `<think>` in a message changes nothing. Text is routed by position:
an event's `text_delta` may lag its token (held back while it could become a stop string), so
every switch is recorded at its offset in the sequence's text and the shown text is cut there.
A marker that is a special token shows no text; one that is not has its text dropped.
"""

from __future__ import annotations

from collections import deque

from opentgi.api.chat.call_scanner import CallScanner, new_tool_call_id
from opentgi.api.chat.forced_json import ToolAnswerStream
from opentgi.api.chat.markers import ThinkTokens
from opentgi.api.chat.tool_formats import ToolCallTokens
from opentgi.api.chat.turn_output import (
    ChatMessage,
    ChatPiece,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
)
from opentgi.engine.events import SequenceResult, TokenEvent

REASONING, TEXT, CALLS = "reasoning", "text", "calls"


class ChatOutputParser:
    """Pure and incremental: `feed(event)` for each event of one sequence, then `finish()`.

    - `think`: the template's think markers (None: no reasoning split); `starts_in_reasoning`: the
      prompt opened the thinking;
    - `tool_calls`: the native tool-call format's tokens (None: no native calls);
    - `forced_json`: TGI's tool contract, the whole answer is one JSON object (call or content).
    """

    def __init__(self, *, think: ThinkTokens | None = None, starts_in_reasoning: bool = False,
                 tool_calls: ToolCallTokens | None = None, forced_json: bool = False):
        self.think = think
        self.tools = tool_calls
        self._state = REASONING if think is not None and starts_in_reasoning else TEXT  # by token ids
        self._shown_state = self._state  # the state at the shown text's end
        self._raw = 0  # characters of the sequence's text so far (special tokens show none)
        self._shown = 0  # characters of it shown (text_delta) so far
        self._switches: deque[tuple[int, int, str]] = deque()  # (offset, marker chars, new state)
        self._dropping = 0  # characters of a marker's text still to leave out of the shown text
        self._started = False  # some token other than a think marker was generated
        self._after_reasoning = False  # strip the blank lines a model writes after `</think>`
        self._scanner: CallScanner | None = None
        self._num_calls = 0
        self._json = ToolAnswerStream() if forced_json else None
        self._held = ""  # whitespace held back between tool calls
        self._answered = False  # answer text was shown (a bare JSON call can no longer open it)
        self.saw_calls = False

    # --- token ids -> switches -----------------------------------------------------------------
    def _switch_for(self, event: TokenEvent) -> str | None:
        token, state = event.token_id, self._state
        if self.think is not None:
            if token == self.think.start_id and state == TEXT and not self._started:
                return REASONING
            if token == self.think.end_id and state == REASONING:
                return TEXT
        if self.tools is not None and state == TEXT and token == self.tools.opener_id:
            return CALLS
        if self.tools is not None and state == CALLS and token == self.tools.closer_id:
            return TEXT
        return None

    def feed(self, event: TokenEvent) -> list[ChatPiece]:
        new_state = self._switch_for(event)
        width = 0 if event.special else len(event.token_text)
        if new_state is not None:
            self._switches.append((self._raw, width, new_state))
            self._state = new_state
        elif self.think is None or event.token_id not in (self.think.start_id, self.think.end_id):
            self._started = self._started or bool(event.token_text.strip()) or event.special
        self._raw += width
        return self._route(event.text_delta)

    def finish(self) -> list[ChatPiece]:
        """The sequence ended: what was held back (a tool call's arguments are out as they come)."""
        if self._json is not None:
            return self._json_pieces(self._json.finish())
        return []

    # --- shown text -> pieces -------------------------------------------------------------------
    def _route(self, text: str) -> list[ChatPiece]:
        out: list[ChatPiece] = []
        while text or (self._switches and self._switches[0][0] <= self._shown):
            if self._dropping and text:  # a marker's own text (it may arrive later than its token)
                n = min(self._dropping, len(text))
                text, self._shown, self._dropping = text[n:], self._shown + n, self._dropping - n
                continue
            if self._switches and self._switches[0][0] <= self._shown and not self._dropping:
                _, self._dropping, state = self._switches.popleft()
                self._enter(state, out)
                continue
            if self._dropping:
                break
            limit = self._switches[0][0] - self._shown if self._switches else len(text)
            part, text = text[:limit], text[limit:]
            self._shown += len(part)
            out += self._emit(part)
        return out

    def _enter(self, state: str, out: list[ChatPiece]) -> None:
        if state == CALLS and self._shown_state == CALLS:  # an opener after a bare JSON call
            self._num_calls = self._scanner.next_index if self._scanner is not None else self._num_calls
        if self._shown_state == REASONING and state == TEXT:
            self._after_reasoning = True
        if state == CALLS:
            self._held = ""
            self._scanner = CallScanner(array=self.tools.format.array, first_index=self._num_calls)
        elif self._shown_state == CALLS and self._scanner is not None:
            self._num_calls = self._scanner.next_index
            self._scanner = None
        self._shown_state = state

    def _emit(self, text: str) -> list[ChatPiece]:
        if not text:
            return []
        state = self._shown_state
        if state == REASONING:
            return [ReasoningDelta(text)]
        if state == CALLS:
            pieces = self._scanner.feed(text) if self._scanner is not None else []
            self._num_calls = max(self._num_calls, self._scanner.next_index if self._scanner else 0)
            self.saw_calls = self.saw_calls or any(isinstance(p, ToolCallStart) for p in pieces)
            return pieces
        if self._after_reasoning:
            text = text.lstrip()
            if not text:
                return []
            self._after_reasoning = False
        if self._json is not None:
            return self._json_pieces(self._json.feed(text))
        if self.tools is not None and self.tools.format.at_start and not self._answered:
            if text.lstrip().startswith("{"):  # the answer opens with a bare JSON call
                self._shown_state = CALLS
                self._scanner = CallScanner(array=False, first_index=self._num_calls)
                return self._emit(text.lstrip())
            self._answered = bool(text.strip())
        if self.tools is not None:  # blank text between calls is no answer: hold it back
            text = self._held + text
            if not text.strip():
                self._held = text
                return []
            self._held = ""
        return [TextDelta(text)]

    def _json_pieces(self, deltas) -> list[ChatPiece]:
        out: list[ChatPiece] = []
        for delta in deltas:
            if delta.kind == "call":
                self.saw_calls = True
                out.append(ToolCallStart(0, new_tool_call_id(), delta.text))
            elif delta.kind == "arguments":
                out.append(ToolCallArguments(0, delta.text))
            elif delta.text:
                out.append(TextDelta(delta.text))
        return out


def parse_sequence(seq: SequenceResult, parser: ChatOutputParser) -> ChatMessage:
    """A finished sequence as one message (its events through `parser`)."""
    message = ChatMessage()
    for event in seq.tokens:
        for piece in parser.feed(event):
            message.add(piece)
    for piece in parser.finish():
        message.add(piece)
    if message.tool_calls:
        message.content = message.content.strip()
    return message
