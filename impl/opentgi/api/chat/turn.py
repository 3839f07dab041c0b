"""The prompt side of a chat turn, shared by every chat dialect: messages and tools in OpenAI chat
form -> the prompt's token ids (the model's chat template), the grammar, the reasoning span and a
factory of output parsers.

Tools take one of two paths:
- **native** (the template shows a tool-call format, `tool_formats.py`, and the client did not ask
  for TGI's contract): the model writes freely; a lazy grammar starts when it writes the opener
  and holds the call to the tools' schema; several calls unless `parallel_tool_calls` is false;
  `tool_choice` "required" or a named function writes the opener at once;
- **forced JSON** (TGI's contract: the request has `tool_prompt`, or the model has no format of
  its own): one JSON object from the first token, a call or `{"content": ...}` (`forced_json.py`).

Grammars (tools and `response_format`) wait until the thinking span is closed; a reasoning budget
closes it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from functools import partial

from opentgi.api.chat.forced_json import tool_grammar_schema
from opentgi.api.chat.markers import ChatMarkers, find_markers
from opentgi.api.chat.parser import ChatOutputParser
from opentgi.api.chat.tools import ToolError, ToolSelection, call_schema, select_tools
from opentgi.api.chat_template import render_chat, select_template
from opentgi.api.images import ImageLimits, chat_image_urls, load_images
from opentgi.engine.errors import ValidationError
from opentgi.engine.request import GrammarSpec, ReasoningSpec

NATIVE, FORCED_JSON, NO_TOOLS = "native", "forced_json", "none"
# OpenAI `reasoning_effort` -> thinking tokens at most (None: no limit)
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}


@dataclass
class ChatTurn:
    """What a dialect hands in, normalised to OpenAI chat form."""

    messages: list[dict]
    tools: list[dict] | None = None  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: str | dict | None = None  # "auto" | "none" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # OpenAI / TGI response_format; applies after the thinking
    chat_template_kwargs: dict | None = None
    reasoning_budget: int | None = None  # thinking tokens at most (None: the server's default)
    tool_prompt: str | None = None  # TGI's tool contract: the forced-JSON answer


@dataclass
class PreparedTurn:
    prompt_token_ids: list[int]
    grammar: GrammarSpec | None
    reasoning: ReasoningSpec | None  # the model's think markers (None: it does not think)
    tools_mode: str  # "native" | "forced_json" | "none"
    markers: ChatMarkers
    _parser: partial
    prompt_text: str = ""  # the rendered template (/chat_tokenize shows it)
    images: list = field(default_factory=list)  # ImageInputs of the prompt's images, in order

    @property
    def using_tools(self) -> bool:
        return self.tools_mode != NO_TOOLS

    def make_parser(self) -> ChatOutputParser:
        """A fresh parser for one generated sequence."""
        return self._parser()


def reasoning_budget_for_effort(effort: str | None) -> int | None:
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise ValidationError(f"`reasoning_effort` must be one of {', '.join(EFFORT_BUDGETS)}. Given: {effort!r}")
    return EFFORT_BUDGETS[effort]


def _template_kwargs(turn: ChatTurn, settings) -> dict:
    given = turn.chat_template_kwargs
    if given is not None and not isinstance(given, dict):
        raise ValidationError("`chat_template_kwargs` must be an object")
    return {**(settings.chat_template_kwargs or {}), **(given or {})}


def _native_grammar(selection: ToolSelection, markers: ChatMarkers, parallel: bool) -> GrammarSpec:
    tokens = markers.tool_calls
    fmt = tokens.format
    schema = call_schema(selection, fmt.arguments_key)
    if fmt.array:
        defs = {k: schema.pop(k) for k in ("$defs", "definitions") if k in schema}
        schema = {"type": "array", "items": schema, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  **defs}
    return GrammarSpec("json", json.dumps(schema), trigger_token_ids=[[tokens.opener_id]],
                       force_trigger=selection.mode in ("required", "named"), trigger_at_start=fmt.at_start,
                       end_token_ids=[tokens.closer_id] if tokens.closer_id is not None else [],
                       repeat=parallel and fmt.several_sections)


def _grammar(turn: ChatTurn, selection: ToolSelection, mode: str, markers: ChatMarkers, settings,
             format_grammar: GrammarSpec | None) -> GrammarSpec | None:
    if mode == NO_TOOLS:
        return format_grammar
    if format_grammar is not None:
        raise ToolError("Grammar and tools are mutually exclusive")
    if mode == FORCED_JSON:
        if settings.disable_grammar_support:
            raise ToolError("Tools need grammar support, which this server has disabled")
        return GrammarSpec("json", json.dumps(tool_grammar_schema(selection)))
    if settings.disable_grammar_support:
        if selection.mode in ("required", "named"):
            raise ToolError("`tool_choice` \"required\" or a named function needs grammar support, which "
                            "this server has disabled")
        return None  # the model writes its calls unconstrained; the parser still reads them
    return _native_grammar(selection, markers, turn.parallel_tool_calls)


async def prepare_chat_turn(engine, turn: ChatTurn, *, settings, max_input_tokens: int | None,
                            format_grammar: GrammarSpec | None = None) -> PreparedTurn:
    """Render, tokenize and constrain one chat turn. `format_grammar` is the dialect's structured
    output (its `response_format` already turned into a GrammarSpec). Raises the API's typed
    validation errors (ValidationError, ToolError, TemplateError, InputTooLongError)."""
    tools = turn.tools or []
    selection = select_tools(tools, turn.tool_choice)
    budget = turn.reasoning_budget if turn.reasoning_budget is not None else settings.reasoning_budget
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValidationError(f"the reasoning budget must be a whole number of tokens >= 0. Given: {budget}")
    template = engine.chat_template()
    source = select_template(template.template, with_tools=bool(tools))
    markers = await find_markers(engine, source, settings.tool_call_parser)
    mode = NO_TOOLS
    if selection.constrained:
        mode = NATIVE if markers.tool_calls is not None and turn.tool_prompt is None else FORCED_JSON
    grammar = _grammar(turn, selection, mode, markers, settings, format_grammar)
    # a model that takes images: the images fetched and checked first (api/images.py); a text-only
    # model refuses image parts while rendering
    takes_images = bool(getattr(engine.info, "image_input", False))
    urls = chat_image_urls(turn.messages) if takes_images else []
    images = await load_images(urls, ImageLimits.of(settings)) if urls else []
    text = await asyncio.to_thread(
        render_chat, template.template, turn.messages, bos_token=template.bos_token,
        eos_token=template.eos_token, special_tokens=template.special_tokens, tools=tools or None,
        tool_prompt=turn.tool_prompt, template_kwargs=_template_kwargs(turn, settings), image_parts=takes_images)
    image_inputs: list = []
    if images:
        prompt_ids, image_inputs = await engine.encode_images(text, images, add_special_tokens=False,
                                                              max_tokens=max_input_tokens)
    else:
        prompt_ids = await engine.encode(text, add_special_tokens=False, max_tokens=max_input_tokens)
    reasoning = None
    think = markers.think
    state = think.prompt_state(prompt_ids) if think is not None else "closed"
    if state == "closed":  # no thinking in this turn (none in the template, or the prompt closed it)
        think = None
    else:
        reasoning = ReasoningSpec([think.start_id], [think.end_id], starts_open=state == "open", budget=budget)
    parser = partial(ChatOutputParser, think=think, starts_in_reasoning=state == "open",
                     tool_calls=markers.tool_calls if mode == NATIVE else None, forced_json=mode == FORCED_JSON)
    return PreparedTurn(prompt_ids, grammar, reasoning, mode, markers, parser, prompt_text=text, images=image_inputs)
