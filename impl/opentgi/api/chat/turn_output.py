"""What a chat turn's output becomes: pieces while it streams (`ChatPiece`), one `ChatMessage` at
the end. Every chat dialect (OpenAI chat, Anthropic Messages, OpenAI Responses) shapes these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking text (between the template's think markers)."""

    text: str


@dataclass(frozen=True)
class TextDelta:
    """Answer text."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: its index in the turn (0, 1, ...), a fresh id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of call `index`'s arguments; a call's fragments concatenate to its JSON text."""

    index: int
    text: str


ChatPiece = ReasoningDelta | TextDelta | ToolCallStart | ToolCallArguments


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ChatMessage:
    """One generated assistant turn."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, piece: ChatPiece) -> None:
        if isinstance(piece, ReasoningDelta):
            self.reasoning += piece.text
        elif isinstance(piece, TextDelta):
            self.content += piece.text
        elif isinstance(piece, ToolCallStart):
            self.tool_calls.append(ToolCall(piece.id, piece.name, ""))
        else:
            self.tool_calls[piece.index].arguments += piece.text
