"""The tool-call formats models are trained to write, found from their chat template.

- `hermes` (Hermes 2 Pro, Qwen 2.5/3, many fine-tunes): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, one section per call, several calls one after the other;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, all calls in one JSON array,
  the turn ends after it;
- `llama3_json` (Llama 3.1/3.2): `{"name": ..., "parameters": {...}}` as the whole answer, or
  after `<|python_tag|>`; one call.

A format is usable only when its markers are single tokens of the model's vocabulary: the engine
recognises them by token id (a lazy grammar starts at the opener; the output parser splits on
them). `--tool-call-parser NAME` overrides the detection (`none`: TGI's forced JSON for every
tool request).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    opener: str  # the token that starts the calls
    closer: str | None  # the token that ends one call (None: the calls end the turn)
    array: bool  # the calls are one JSON array after the opener
    arguments_key: str  # "arguments" | "parameters"
    at_start: bool = False  # a call may also be written as bare JSON opening the answer

    @property
    def several_sections(self) -> bool:
        """Each call has its own opener and closer (parallel calls are several sections)."""
        return self.closer is not None


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", array=False, arguments_key="arguments"),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", None, array=True, arguments_key="arguments"),
    "llama3_json": ToolCallFormat("llama3_json", "<|python_tag|>", None, array=False,
                                  arguments_key="parameters", at_start=True),
}
NO_PARSER = "none"
PARSER_NAMES = (*FORMATS, NO_PARSER)


def detect_format(template_source: str | None) -> ToolCallFormat | None:
    """The format a chat template shows the model (its opener appears in the template)."""
    if not template_source:
        return None
    for fmt in FORMATS.values():
        if fmt.opener in template_source:
            return fmt
    return None


@dataclass(frozen=True)
class ToolCallTokens:
    """A format with its markers' token ids in this model's vocabulary."""

    format: ToolCallFormat
    opener_id: int
    closer_id: int | None
