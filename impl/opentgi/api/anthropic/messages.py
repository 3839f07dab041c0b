"""An Anthropic Messages request in OpenAI chat form (the shared chat turn's input), and its
sampling parameters.

    system (string or text blocks)      -> a system message
    user text blocks                     -> user messages
    user tool_result blocks              -> tool messages (tool_call_id = tool_use_id)
    assistant text / thinking / tool_use -> content / reasoning_content / tool_calls
    tools, tool_choice                   -> OpenAI function tools, "auto" | "required" | "none" | a named function
    thinking                             -> chat_template_kwargs {"enable_thinking": ...} and the reasoning budget

Image and document blocks are refused: the served models read text only.
"""

from __future__ import annotations

import json
from typing import Any

from opentgi.engine.errors import InputTooLongError, NotSupportedError, ValidationError
from opentgi.engine.request import SamplingParams
from opentgi.schemas import anthropic as schema

REFUSED_BLOCKS = ("image", "document")


def _refuse_media(block_type: str, where: str) -> None:
    raise NotSupportedError(f"{where}: `{block_type}` content blocks are not supported: the served model reads "
                            f"text only")


def system_text(system: str | list[schema.TextBlockParam] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def _tool_result_text(block: schema.ToolResultBlockParam, where: str) -> str:
    content = block.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type in REFUSED_BLOCKS:
            _refuse_media(part.type, f"{where}.content.{i}")
        texts.append(part.text)
    return "\n".join(texts)


def image_part(source: dict, where: str) -> dict:
    """An `image` block's source (`base64` or `url`) as an OpenAI `image_url` part."""
    kind = source.get("type")
    if kind == "base64":
        return {"type": "image_url",
                "image_url": {"url": f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"}}
    if kind == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url", "")}}
    raise ValidationError(f"{where}: an image source is `base64` or `url`, not {kind!r}")


def _user_messages(message: schema.InputMessage, where: str, images: bool = False) -> list[dict]:
    """A user turn: its tool results as tool messages and its text (and with `images`, its image
    blocks as `image_url` parts) as user messages, in order."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict] = []
    texts: list[str] = []
    parts: list[dict] = []  # the same content as parts, images included

    def flush() -> None:
        if any(part["type"] == "image_url" for part in parts):
            out.append({"role": "user", "content": list(parts)})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
        texts.clear()
        parts.clear()

    for i, block in enumerate(message.content):
        at = f"{where}.content.{i}"
        if block.type == "image" and images:
            parts.append(image_part(block.source, at))
        elif block.type in REFUSED_BLOCKS:
            _refuse_media(block.type, at)
        elif block.type == "text":  # texts joined by newlines, as parts too
            parts.append({"type": "text", "text": ("\n" if texts else "") + block.text})
            texts.append(block.text)
        elif block.type == "tool_result":
            flush()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block, at)})
        elif block.type in ("thinking", "redacted_thinking", "tool_use"):
            raise ValidationError(f"{at}: `{block.type}` blocks belong to assistant messages")
    flush()
    return out


def _assistant_message(message: schema.InputMessage, where: str) -> dict:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, thinking, calls = [], [], []
    for i, block in enumerate(message.content):
        at = f"{where}.content.{i}"
        if block.type in REFUSED_BLOCKS:
            _refuse_media(block.type, at)
        elif block.type == "text":
            texts.append(block.text)
        elif block.type == "thinking":
            thinking.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type == "tool_result":
            raise ValidationError(f"{at}: `tool_result` blocks belong to user messages")
        # redacted_thinking: encrypted upstream, nothing to show the model
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def chat_messages(system: Any, messages: list[schema.InputMessage], images: bool = False) -> list[dict]:
    """OpenAI chat messages for the system prompt and Anthropic `messages`; `images`: the model
    takes them (else image blocks are refused)."""
    if not messages:
        raise ValidationError("messages: at least one message is required")
    out = []
    text = system_text(system)
    if text:
        out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if message.role.value == "user":
            out.extend(_user_messages(message, where, images))
        else:
            out.append(_assistant_message(message, where))
    return out


def chat_tools(tools: list[schema.Tool] | None) -> list[dict] | None:
    if not tools:
        return None
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValidationError(f"tools: tool names must be unique ({', '.join(duplicates)})")
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description or "",
        "parameters": t.input_schema.model_dump(mode="json", exclude_none=True)}} for t in tools]


def chat_tool_choice(tool_choice, tools: list[dict] | None) -> tuple[str | dict | None, bool]:
    """(OpenAI tool_choice, parallel tool calls allowed)."""
    if tool_choice is None:
        return ("auto" if tools else None), True
    parallel = not getattr(tool_choice, "disable_parallel_tool_use", False)
    kind = tool_choice.type
    if kind == "none":
        return "none", True
    if not tools:
        raise ValidationError(f"tool_choice: `{kind}` needs `tools`")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    names = [t["function"]["name"] for t in tools]
    if tool_choice.name not in names:
        raise ValidationError(f"tool_choice.name: no tool is named {tool_choice.name!r} "
                              f"(tools: {', '.join(names)})")
    return {"type": "function", "function": {"name": tool_choice.name}}, parallel


def thinking_options(thinking, max_tokens: int | None) -> tuple[dict | None, int | None]:
    """(chat_template_kwargs, reasoning budget) for the `thinking` config; None: the template's default."""
    if thinking is None:
        return None, None
    if thinking.type == "disabled":
        return {"enable_thinking": False}, None
    if thinking.type == "enabled":
        if max_tokens is not None and thinking.budget_tokens >= max_tokens:
            raise ValidationError(f"thinking.budget_tokens: must be less than max_tokens ({max_tokens}). "
                                  f"Given: {thinking.budget_tokens}")
        return {"enable_thinking": True}, thinking.budget_tokens
    return {"enable_thinking": True}, None  # adaptive: the model decides how long to think


# output_config.effort -> thinking tokens at most (None: no limit)
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": None, "xhigh": None, "max": None}


def output_options(output_config) -> tuple[dict | None, int | None]:
    """(OpenAI response_format, thinking budget) for `output_config`."""
    if output_config is None:
        return None, None
    dump = output_config.model_dump(mode="json", by_alias=True, exclude_none=True)
    fmt = dump.get("format")
    response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}} \
        if fmt else None
    return response_format, EFFORT_BUDGETS.get(dump.get("effort"))


def sampling_params(request: schema.MessagesRequest) -> SamplingParams:
    """Anthropic's defaults: temperature 1.0, no top_p / top_k. Temperature 0 (or top_p 0, which keeps
    only the likeliest token) is greedy."""
    temperature = 1.0 if request.temperature is None else request.temperature
    if temperature == 0 or request.top_p == 0:
        return SamplingParams(do_sample=False)
    return SamplingParams(
        do_sample=True,
        temperature=float(temperature),
        top_p=1.0 if request.top_p is None else float(request.top_p),
        top_k=request.top_k or 0,
    )


def stop_sequences(stops: list[str] | None, max_stop_sequences: int) -> list[str]:
    stops = list(stops or [])
    if any(s == "" for s in stops):
        raise ValidationError("stop_sequences: each stop sequence must contain non-whitespace")
    if len(stops) > max_stop_sequences:
        raise ValidationError(f"stop_sequences: at most {max_stop_sequences} stop sequences "
                              f"(--max-stop-sequences). Given: {len(stops)}")
    return stops


def matched_stop_sequence(stops: list[str], full_text: str) -> str | None:
    """Which stop sequence ended the output: the one found first in the text generated in full."""
    found = [(full_text.find(s), -len(s), s) for s in stops if s in full_text]
    return min(found)[2] if found else None


def check_lengths(num_prompt_tokens: int, max_tokens: int, max_input_tokens: int, max_total_tokens: int) -> None:
    """The prompt within --max-input-tokens, and prompt + max_tokens within --max-total-tokens."""
    if num_prompt_tokens > max_input_tokens:
        raise InputTooLongError(f"prompt is too long: {num_prompt_tokens} tokens > {max_input_tokens} maximum",
                                input_tokens=num_prompt_tokens, max_new_tokens=max_tokens, limit=max_input_tokens)
    if num_prompt_tokens + max_tokens > max_total_tokens:
        raise InputTooLongError(
            f"prompt tokens + max_tokens must be <= {max_total_tokens}. Given: {num_prompt_tokens} prompt tokens "
            f"and {max_tokens} max_tokens", input_tokens=num_prompt_tokens, max_new_tokens=max_tokens,
            limit=max_total_tokens)
