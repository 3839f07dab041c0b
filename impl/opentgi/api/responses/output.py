"""The Response object and its output items (reasoning, message, function_call), as OpenAI shapes them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from opentgi.engine.request import FinishReason


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseMeta:
    """What every snapshot of one response repeats: its id, time, model and the request's settings."""

    model: str
    echo: dict[str, Any]  # instructions, tools, tool_choice, ... as the request gave them
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


def request_echo(request, tool_choice: str | dict | None) -> dict[str, Any]:
    """The request's settings a Response repeats (OpenAI's defaults where it gave none)."""
    dump = request.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {
        "instructions": request.instructions,
        "previous_response_id": request.previous_response_id,
        "max_output_tokens": request.max_output_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": dump.get("tool_choice", "auto" if tool_choice is None else tool_choice),
        "tools": dump.get("tools", []),
        "reasoning": dump.get("reasoning"),
        "text": dump.get("text", {"format": {"type": "text"}}),
        "store": request.store is not False,
        "metadata": request.metadata or {},
    }


def is_incomplete(reason: FinishReason | None) -> bool:
    return reason in (FinishReason.LENGTH, FinishReason.CONTEXT)


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int,
          prefix_caching: bool = True) -> dict:
    """`cached_tokens`: prompt tokens the prefix cache served; `cache_write_tokens`: the others, which
    the prefix cache keeps for later requests (none with --disable-prefix-caching)."""
    written = prompt_tokens - cached_tokens if prefix_caching else 0
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": written},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(reasoning: str, content: str, tool_calls, incomplete: bool) -> list[dict]:
    """A finished answer's items: reasoning, then the message (also when empty and nothing else
    came), then one function_call per call."""
    status = "incomplete" if incomplete else "completed"
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, status))
    calls = [function_call_item(new_id("fc"), c.id, c.name, c.arguments, status) for c in tool_calls]
    if content or not calls:
        items.append(message_item(new_id("msg"), content, status))
    return items + calls


def response_object(meta: ResponseMeta, status: str, items: list[dict], usage_value: dict | None = None) -> dict:
    """A Response: `status` in_progress (stream snapshots), completed or incomplete."""
    response = {"id": meta.id, "object": "response", "created_at": meta.created_at, "status": status,
                "model": meta.model, "output": items,
                "error": None, "incomplete_details": None, "usage": usage_value, **meta.echo}
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response
