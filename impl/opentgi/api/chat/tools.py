"""Which tools a chat turn may call, and the JSON schema of one call.

`tool_choice`: `"none"` (tools shown to the template, no constraint), `"auto"` (the default when
tools are given), `"required"` (one of the tools), a function name, or
`{"type": "function", "function": {"name": ...}}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentgi.api.chat.call_scanner import new_tool_call_id
from opentgi.engine.errors import ValidationError

__all__ = ["ToolError", "ToolSelection", "call_schema", "new_tool_call_id", "select_tools"]


class ToolError(ValidationError):
    """A tool request that cannot be served (TGI: 422, error_type "tool_error")."""

    error_type = "tool_error"


@dataclass
class ToolSelection:
    """What the tools of a request allow: `mode` is "none" | "auto" | "required" | "named"."""

    mode: str
    tools: list[dict] = field(default_factory=list)  # the tools the model may call (OpenAI shape)

    @property
    def constrained(self) -> bool:
        return self.mode != "none"


def _function(tool: dict, index: int) -> dict:
    if tool.get("type", "function") != "function":
        raise ToolError(f"tools[{index}]: only tools of type \"function\" are supported")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolError(f"tools[{index}]: `function.name` is required")
    schema = _parameters(function)
    if not isinstance(schema, dict):
        raise ToolError(f"tools[{index}]: `function.parameters` must be a JSON schema object")
    return function


def _parameters(function: dict):
    """The function's JSON schema: OpenAI names it `parameters`, TGI 2.1 `arguments` (an alias)."""
    schema = function.get("parameters")
    if schema is None:
        schema = function.get("arguments")
    return {"type": "object", "properties": {}} if schema is None else schema


def select_tools(tools: list[dict] | None, tool_choice) -> ToolSelection:
    """Resolve `tools` + `tool_choice` (OpenAI and TGI forms) into a ToolSelection."""
    tools = list(tools or [])
    names = [_function(t, i)["name"] for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise ToolError("Tool names must be unique")
    if isinstance(tool_choice, dict):
        if not tool_choice:  # TGI's empty object: no preference
            tool_choice = None
        else:
            name = (tool_choice.get("function") or {}).get("name")
            if not isinstance(name, str):
                raise ToolError("`tool_choice` object must be {\"type\": \"function\", \"function\": "
                                "{\"name\": ...}}")
            tool_choice = {"name": name}
    if not tools:
        if tool_choice in (None, "none", "auto"):
            return ToolSelection("none")
        raise ToolError("`tool_choice` requires `tools`")
    if tool_choice is None or tool_choice == "auto":
        return ToolSelection("auto", tools)
    if tool_choice == "none":
        return ToolSelection("none", tools)
    if tool_choice == "required":
        return ToolSelection("required", tools)
    name = tool_choice["name"] if isinstance(tool_choice, dict) else tool_choice
    if not isinstance(name, str) or name not in names:
        raise ToolError(f"Tool with name {name} not found")
    return ToolSelection("named", [tools[names.index(name)]])


def _hoist_definitions(schema: dict, defs: dict) -> dict:
    """Move a parameters schema's `$defs`/`definitions` to the root of the combined grammar, so
    `#/$defs/...` references still resolve."""
    schema = dict(schema)
    for key in ("$defs", "definitions"):
        if key in schema:
            defs.setdefault(key, {}).update(schema.pop(key))
    return schema


def call_schema(selection: ToolSelection, arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call of any of the selected tools: `{"name": ..., "<arguments_key>":
    {...}}` (name first: it streams before the arguments), definitions hoisted to the root."""
    defs: dict = {}
    alternatives = []
    for tool in selection.tools:
        function = tool["function"]
        alternatives.append({
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": function["name"]},
                arguments_key: _hoist_definitions(_parameters(function), defs),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**schema, **defs}
