"""The chat turn every chat dialect shares (OpenAI chat, Anthropic Messages, OpenAI Responses):
`prepare_chat_turn` (messages + tools -> prompt ids, grammar, reasoning span, parser factory) and
`ChatOutputParser` (a sequence's tokens -> thinking, text and tool-call pieces)."""

from opentgi.api.chat.parser import ChatOutputParser, parse_sequence
from opentgi.api.chat.tools import ToolError, new_tool_call_id
from opentgi.api.chat.turn import ChatTurn, PreparedTurn, prepare_chat_turn, reasoning_budget_for_effort
from opentgi.api.chat.turn_output import (
    ChatMessage,
    ChatPiece,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)

__all__ = [
    "ChatMessage",
    "ChatOutputParser",
    "ChatPiece",
    "ChatTurn",
    "PreparedTurn",
    "ReasoningDelta",
    "TextDelta",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolError",
    "new_tool_call_id",
    "parse_sequence",
    "prepare_chat_turn",
    "reasoning_budget_for_effort",
]
