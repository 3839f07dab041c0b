"""A Responses request's input in OpenAI chat form (the shared chat turn's input).

    input "text"                        -> a user message
    message items (user/system/developer/assistant; input_text, output_text, refusal parts)
                                        -> messages (developer as system)
    function_call items                 -> tool_calls of one assistant message (consecutive calls merge)
    function_call_output items          -> tool messages (tool_call_id = call_id)
    reasoning items                     -> reasoning_content of the assistant message that follows
    instructions                        -> the system message first (never stored with the conversation)
    tools (function), tool_choice, text.format -> OpenAI chat tools, tool_choice, response_format

`input_image` / `input_file` parts and other tool types are refused: the served models read text.
"""

from __future__ import annotations

from typing import Any

from opentgi.engine.errors import NotSupportedError, ValidationError
from opentgi.schemas import openai_responses as schema

TEXT_PARTS = ("input_text", "output_text")


def _text_of(content: str | list[schema.InputContent], where: str, images: bool = False) -> str | list[dict]:
    """The content as text; with `images` (the model takes them) and an `input_image` among the
    parts, as OpenAI chat parts (`text`, `image_url`)."""
    if isinstance(content, str):
        return content
    takes_images = images and any(part.type.value == "input_image" for part in content)
    texts, parts = [], []
    for i, part in enumerate(content):
        kind = part.type.value
        if kind == "input_image" and takes_images:
            if not part.image_url:
                raise ValidationError(f"{where}.{i}: an `input_image` part needs `image_url`")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
            continue
        if kind in ("input_image", "input_file"):
            raise NotSupportedError(f"{where}.{i}: `{kind}` content is not supported: the served model reads text only")
        text = part.refusal if kind == "refusal" else part.text
        if text is None:
            raise ValidationError(f"{where}.{i}: a `{kind}` part needs `{'refusal' if kind == 'refusal' else 'text'}`")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    return parts if takes_images else "".join(texts)


class _Conversation:
    """Builds the chat messages in order, merging an assistant turn's text, reasoning and calls."""

    def __init__(self, images: bool = False):
        self.images = images
        self.messages: list[dict] = []
        self.pending_reasoning: list[str] = []

    def _assistant(self, fresh: bool) -> dict:
        last = self.messages[-1] if self.messages else None
        if fresh or last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self.pending_reasoning:
            last["reasoning_content"] = last.get("reasoning_content", "") + "".join(self.pending_reasoning)
            self.pending_reasoning.clear()
        return last

    def add(self, item, where: str) -> None:
        if isinstance(item, schema.InputMessage):
            role = item.role.value
            text = _text_of(item.content, f"{where}.content", self.images and role == "user")
            if role == "assistant":
                self._assistant(fresh=True)["content"] = text
            else:
                self.messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif isinstance(item, schema.FunctionCallItem):
            message = self._assistant(fresh=False)
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, schema.FunctionCallOutputItem):
            self.messages.append({"role": "tool", "tool_call_id": item.call_id,
                                  "content": _text_of(item.output, f"{where}.output")})
        elif isinstance(item, schema.ReasoningItem):
            texts = [part.text for part in item.content or []] or [part.text for part in item.summary or []]
            self.pending_reasoning.extend(texts)


def input_messages(input_: Any, images: bool = False) -> list[dict]:
    """The request's `input` as chat messages (reasoning with no assistant turn after it is dropped);
    `images`: the model takes them (else `input_image` parts are refused)."""
    if input_ is None:
        return []
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    conversation = _Conversation(images)
    for i, item in enumerate(input_):
        conversation.add(item, f"input.{i}")
    return conversation.messages


def assistant_message(reasoning: str, content: str, tool_calls) -> dict:
    """The model's answer as the assistant message a follow-up's prompt continues from."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in tool_calls]
    if calls:
        message["tool_calls"] = calls
    return message


def chat_tools(tools: list[schema.Tool] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise NotSupportedError(f"tools.{i}.type: only `function` tools are supported. Given: {tool.type!r}")
        if not tool.name:
            raise ValidationError(f"tools.{i}.name: a function tool needs a name")
        out.append({"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                     "parameters": tool.parameters or {"type": "object"}}})
    names = [t["function"]["name"] for t in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValidationError(f"tools: function names must be unique ({', '.join(duplicates)})")
    return out


def chat_tool_choice(tool_choice, tools: list[dict] | None) -> str | dict | None:
    if tool_choice is None:
        return "auto" if tools else None
    if isinstance(tool_choice, schema.ToolChoiceFunction):
        names = [t["function"]["name"] for t in tools or []]
        if tool_choice.name not in names:
            raise ValidationError(f"tool_choice.name: no function tool is named {tool_choice.name!r}")
        return {"type": "function", "function": {"name": tool_choice.name}}
    choice = tool_choice.value
    if choice == "required" and not tools:
        raise ValidationError("tool_choice: `required` needs `tools`")
    return choice


def response_format(text: schema.TextConfig | None) -> dict | None:
    """`text.format` as OpenAI chat's response_format (the engine's grammar, after any thinking)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type.value == "text":
        return None
    if fmt.type.value == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise ValidationError("text.format.schema: a `json_schema` format needs `schema`")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_,
                                                   "strict": bool(fmt.strict)}}
