"""The bounds a grammar must keep, checked before any other work on it (cheap: no parsing of the
value beyond what the request already parsed, one walk of a schema document). Importable without
torch or xgrammar, so the API checks them as it reads a request.

Without them, one huge schema (tens of thousands of properties) would hold the event loop while it
is checked and a compile thread for minutes. The bounds are generous for real response formats
and tool sets; each refusal is a GrammarError (422) naming the bound.
"""

from __future__ import annotations

import re
from typing import Any

from opentgi.engine.errors import GrammarError
from opentgi.engine.request import GrammarSpec

MAX_SCHEMA_CHARS = 64_000  # the schema as compact JSON text
MAX_SCHEMA_DEPTH = 32  # nesting of objects / arrays in the schema document
MAX_SCHEMA_NODES = 2_000  # objects, arrays and values in the schema document
# xgrammar's compile time grows with the square of an object's properties: this many still
# compiles well within COMPILE_TIMEOUT_S.
MAX_OBJECT_PROPERTIES = 256
MAX_REGEX_CHARS = 4_000
MAX_REGEX_REPEAT = 1_000  # the largest bound of a {n,m} repetition
COMPILE_TIMEOUT_S = 30.0  # a compile still running then is a 422 (TGI-style)
NORMALISED_CACHE_SIZE = 256  # normalised schemas kept, keyed by the SHA-256 of the text
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def _invalid(detail: str) -> GrammarError:
    return GrammarError(f"grammar is not valid: {detail}")


def check_bounds(spec: GrammarSpec) -> None:
    """The size bounds above, cheap (one walk of the document), checked before anything else."""
    value = spec.value
    if spec.type == "regex":
        if isinstance(value, str):
            if len(value) > MAX_REGEX_CHARS:
                raise _invalid(f"the regex has {len(value)} characters; at most {MAX_REGEX_CHARS} are allowed")
            for low, high in _REPEAT.findall(value):
                if max(int(low), int(high or 0)) > MAX_REGEX_REPEAT:
                    raise _invalid(f"a regex repetition bound is larger than {MAX_REGEX_REPEAT}")
        return
    if isinstance(value, (str, bytes)):
        if len(value) > MAX_SCHEMA_CHARS:
            raise _invalid(f"the JSON schema has {len(value)} characters; at most {MAX_SCHEMA_CHARS} are allowed")
        return  # parsed (and walked) by grammar_key, off the event loop
    check_document(value)


def check_document(value: Any) -> None:
    nodes = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _invalid(f"the JSON schema has more than {MAX_SCHEMA_NODES} nodes")
        if depth > MAX_SCHEMA_DEPTH:
            raise _invalid(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(item, dict):
            properties = item.get("properties")
            if isinstance(properties, dict) and len(properties) > MAX_OBJECT_PROPERTIES:
                raise _invalid(f"an object of the JSON schema has {len(properties)} properties; at most "
                               f"{MAX_OBJECT_PROPERTIES} are allowed")
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
