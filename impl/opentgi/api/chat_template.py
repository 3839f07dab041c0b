"""Chat templates: turn OpenAI-style messages (and tools) into the model's prompt text.

Rendered like transformers' `apply_chat_template`: a sandboxed jinja2 environment with
`trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII
characters, and the globals `raise_exception` and `strftime_now`. The template receives `messages`,
`tools` (unlike TGI 2.1, which never passes them), `add_generation_prompt` and the tokenizer's
special tokens (`bos_token`, `eos_token`, ...).

When tools are offered but the template never mentions `tools`, the tool prompt and the tools' JSON
schema are appended to the last message instead (what TGI 2.1 does for every template), so the
model still sees them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from opentgi.engine.errors import TemplateError, ValidationError

# TGI's default `tool_prompt` (ChatRequest.tool_prompt in the TGI document).
DEFAULT_TOOL_PROMPT = (
    "You will be presented with a JSON schema representing a set of tools.\n"
    "If the user request lacks of sufficient information to make a precise tool selection: "
    "Do not invent any tool's properties, instead notify with an error message.\n\nJSON Schema:\n"
)


class _TemplateRaised(Exception):
    """`raise_exception(...)` called by a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) a chat template; a syntax error is a TemplateError."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(str(exc)) from exc


def select_template(chat_template: str | dict | list | None, *, with_tools: bool) -> str:
    """The template source to use: a plain string, or from named templates (`default`, or
    `tool_use` when tools are offered and the model has one)."""
    if chat_template is None:
        raise TemplateError("template not found (this model has no chat template)")
    if isinstance(chat_template, str):
        return chat_template
    if isinstance(chat_template, list):  # tokenizer_config.json form: [{"name": ..., "template": ...}]
        chat_template = {t["name"]: t["template"] for t in chat_template}
    if with_tools and "tool_use" in chat_template:
        return chat_template["tool_use"]
    if "default" in chat_template:
        return chat_template["default"]
    raise TemplateError("the model's named chat templates have no \"default\" entry")


def _text_of(content: Any, index: int, image_parts: bool = False) -> str | list[dict] | None:
    """A message's content as one string: multi-part text is joined; images are refused. With
    `image_parts` (a model that takes images): the content as parts, as transformers' processors
    render it (`{"type": "text", "text": ...}`, and `{"type": "image"}` where an image goes)."""
    if content is None or isinstance(content, str):
        return [{"type": "text", "text": content or ""}] if image_parts else content
    parts: list[str] = []
    as_parts: list[dict] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(part.get("text", ""))
            as_parts.append({"type": "text", "text": part.get("text", "")})
        elif kind in ("image_url", "image") and image_parts:
            as_parts.append({"type": "image"})
        elif kind in ("image_url", "image", "input_audio"):
            raise ValidationError(
                f"messages[{index}]: content part of type \"{kind}\" is not supported: this model "
                "takes text only")
        else:
            raise ValidationError(f"messages[{index}]: unknown content part type {kind!r}")
    return as_parts if image_parts else "".join(parts)


def _tool_call_for_template(call: dict) -> dict:
    """Assistant tool calls as templates expect them: `arguments` as an object when it parses."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def normalize_messages(messages: list[dict], image_parts: bool = False) -> list[dict]:
    """OpenAI messages as plain dicts the templates understand (content a string, or with
    `image_parts` a list of parts: `_text_of`)."""
    if not messages:
        raise ValidationError("`messages` must not be empty")
    out = []
    for i, message in enumerate(messages):
        msg = {k: v for k, v in message.items() if v is not None}
        msg["content"] = _text_of(message.get("content"), i, image_parts)
        if msg["content"] is None:
            # Templates concatenate content; an assistant turn that only called tools has none.
            msg["content"] = ""
        if message.get("tool_calls"):
            msg["tool_calls"] = [_tool_call_for_template(c) for c in message["tool_calls"]]
        out.append(msg)
    return out


def template_mentions_tools(source: str) -> bool:
    return "tools" in source


def render_chat(
    chat_template: str | dict | list | None,
    messages: list[dict],
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict] | None = None,
    tool_prompt: str | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    image_parts: bool = False,
) -> str:
    """Render the conversation into the prompt text. `template_kwargs` (a request's
    `chat_template_kwargs`, e.g. `enable_thinking`) are more variables the template sees; they may
    not replace the conversation's own. Raises ValidationError / TemplateError."""
    source = select_template(chat_template, with_tools=bool(tools))
    template = compile_template(source)
    msgs = normalize_messages(messages, image_parts)
    if tools and not template_mentions_tools(source):
        prompt = DEFAULT_TOOL_PROMPT if tool_prompt is None else tool_prompt
        tools_json = json.dumps({"tools": tools}, ensure_ascii=False, separators=(",", ":"))
        last = dict(msgs[-1])
        if isinstance(last["content"], list):
            last["content"] = [*last["content"], {"type": "text", "text": f"\n---\n{prompt}{tools_json}"}]
        else:
            last["content"] = f"{last['content']}\n---\n{prompt}{tools_json}" if last["content"] \
                else f"{prompt}{tools_json}"
        msgs[-1] = last
    reserved = {"messages", "tools", "add_generation_prompt"}.intersection(template_kwargs or {})
    if reserved:
        raise ValidationError(f"`chat_template_kwargs` may not set {', '.join(sorted(reserved))}")
    variables: dict[str, Any] = {**(template_kwargs or {}), **(special_tokens or {})}
    variables.update(bos_token=bos_token or "", eos_token=eos_token or "")
    try:
        return template.render(messages=msgs, tools=tools or None,
                               add_generation_prompt=add_generation_prompt, **variables)
    except _TemplateRaised as exc:
        raise TemplateError(str(exc)) from exc
    except jinja2.TemplateError as exc:
        raise TemplateError(str(exc)) from exc
    except Exception as exc:
        raise TemplateError(f"{type(exc).__name__}: {exc}") from exc
