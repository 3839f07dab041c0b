"""Schemathesis property tests: every operation of every document in openapi/, against the live server.

Each document is served where the app mounts it (`opentgi.api.app.mounts_for`), so the documents the
other dialects add are picked up here without editing this file. All of schemathesis' default
checks run, with a fixed seed and a bounded number of examples: 15 per operation and every phase
(examples, coverage, fuzzing, stateful) under the `ci` hypothesis profile; under `fast` (the fast
tier) a fifth of the examples and no coverage phase, whose case count no budget bounds.

Two adjustments, for the test run only (the documents are not changed):
  * Before OpenAPI 3.2, schemathesis reads a `text/event-stream` schema as one event
    `{data, event, id, retry}`. Each such schema is rewrapped so an event's `data` string carries the
    document's payload schema as `contentSchema`: every event's JSON payload is validated. A stream
    may also end with an error event in the shape of the operation's documented error responses
    (TGI streams its errors in-band), and OpenAI-style streams end with the sentinel `[DONE]`.
  * `positive_data_acceptance` also accepts the validation status a document gives (TGI's 422,
    LightLLM's and SenseNova's 400): a request the schema allows can still break a rule no schema
    can state (prompt tokens + max_new_tokens <= max_total_tokens, top_p < 1, sampling required by
    best_of). The error's body is still checked against the document's error schema.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import hypothesis
import schemathesis
import schemathesis.wfc.escalation  # noqa: F401  (see below)
import yaml
from schemathesis.config import SchemathesisConfig

from opentgi.api.app import mounts_for
from tests.helpers.hypothesis_profiles import examples, smoke

# schemathesis imports `schemathesis.wfc.escalation` lazily, inside the first test's reauth check
# while the live server's threads run, and pytest rewrites a plugin's modules as they are imported:
# that compile has failed under CPython 3.11 with "AST constructor recursion depth mismatch"
# (python/cpython#106905). Imported above, at collection, it is compiled once before any server runs.

OPENAPI_DIR = Path(__file__).resolve().parents[1] / "openapi"
SSE = "text/event-stream"
DONE_SENTINEL = "[DONE]"
MAX_EXAMPLES = examples(15)
SEED = 20240718


def documents() -> list[Path]:
    return sorted(p for p in OPENAPI_DIR.iterdir() if p.suffix in (".json", ".yaml", ".yml"))


def load_document(path: Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle) if path.suffix == ".json" else yaml.safe_load(handle)


OPENAPI_ONLY_KEYWORDS = ("nullable", "example", "discriminator", "xml", "externalDocs", "deprecated",
                         "readOnly", "writeOnly")


def resolve(document: dict, node):
    seen = set()
    while isinstance(node, dict) and "$ref" in node and node["$ref"] not in seen:
        seen.add(node["$ref"])
        target = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        node = target
    return node


def to_json_schema(node, document: dict, refs: tuple = ()):
    """An OpenAPI 3.0 schema as plain JSON Schema (refs inlined, `nullable` as a null branch).

    schemathesis converts OpenAPI's dialect in response schemas, but not inside a `contentSchema`.
    """
    if isinstance(node, list):
        return [to_json_schema(item, document, refs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        if node["$ref"] in refs:  # a recursive schema: stop inlining
            return {}
        return to_json_schema(resolve(document, node), document, (*refs, node["$ref"]))
    out = {}
    for key, value in node.items():
        if key in OPENAPI_ONLY_KEYWORDS:
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: to_json_schema(sub, document, refs) for name, sub in value.items()}
        else:
            out[key] = to_json_schema(value, document, refs)
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _error_schemas(operation: dict, document: dict) -> list[dict]:
    """The payload schemas of an operation's documented error responses (any media type)."""
    found: list[dict] = []
    for status, response in (operation.get("responses") or {}).items():
        if str(status)[:1] not in ("4", "5"):
            continue
        for media in (resolve(document, response).get("content") or {}).values():
            schema = media.get("schema") if isinstance(media, dict) else None
            if schema is not None and schema not in found:
                found.append(schema)
    return found


def _event_schema(payload: dict, alternatives: list[dict]) -> dict:
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [payload, *alternatives]} if alternatives else payload}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"type": "string", "enum": [DONE_SENTINEL]}, data]}},
    }


def rewrap_event_streams(document: dict) -> dict:
    """A copy of `document` whose SSE schemas describe one event with the payload as contentSchema."""
    original, document = document, copy.deepcopy(document)
    for path_item in (document.get("paths") or {}).values():
        for operation in path_item.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            errors = [to_json_schema(e, original) for e in _error_schemas(operation, original)]
            for status, response in operation["responses"].items():
                media = (resolve(document, response).get("content") or {}).get(SSE)
                if not isinstance(media, dict) or "schema" not in media or media.get("x-rewrapped"):
                    continue
                alternatives = errors if str(status).startswith("2") else []
                media["schema"] = _event_schema(to_json_schema(media["schema"], original), alternatives)
                media["x-rewrapped"] = True
    return document


def base_path_of(document: Path, settings) -> str:
    for mount in mounts_for(settings):
        if Path(mount.dialect.document).stem == document.stem:
            return mount.base_path
    raise LookupError(f"the app mounts no dialect for {document.name}; add it to opentgi.api.app.DIALECTS")


DEFAULT_ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]


def documented_validation_statuses(document: dict) -> list[str]:
    """The statuses a document gives for requests its schemas cannot rule out (400 / 422), and
    those of responses marked `x-model-kind-refusal` (TEI's 424 for a route the served model does
    not serve: the live server serves a generation model)."""
    found = set()
    for path_item in (document.get("paths") or {}).values():
        for operation in path_item.values():
            if isinstance(operation, dict):
                for status, response in (operation.get("responses") or {}).items():
                    if str(status) in ("400", "422") or resolve(document, response).get("x-model-kind-refusal"):
                        found.add(str(status))
    return sorted(found)


def schemathesis_config(base_url: str, accepted: list[str], *, stateful: bool = False) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict({
        "base-url": base_url,
        "request-timeout": 60,
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "phases": {"examples": {"enabled": True}, "coverage": {"enabled": not smoke()},
                   "fuzzing": {"enabled": True}, "stateful": {"enabled": stateful}},
        "checks": {"positive_data_acceptance": {"expected-statuses": DEFAULT_ACCEPTED + accepted}},
    })


def has_links(document: dict) -> bool:
    return any("links" in (response or {})
               for path_item in (document.get("paths") or {}).values()
               for operation in path_item.values() if isinstance(operation, dict)
               for response in (operation.get("responses") or {}).values())


def _operation_tests(document: Path):
    """One schemathesis test per operation of `document`, aimed at the live server's mount of it."""
    raw = load_document(document)
    config = schemathesis_config("http://127.0.0.1", documented_validation_statuses(raw))
    api = schemathesis.openapi.from_dict(rewrap_event_streams(raw), config=config)

    @api.parametrize()
    @hypothesis.seed(SEED)
    @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def test_operation(case, live_server, live_settings):
        case.call_and_validate(base_url=live_server + base_path_of(document, live_settings))

    return test_operation


STATEFUL_EXAMPLES = examples(8)
STATEFUL_STEPS = 4


def _stateful_test(document: Path):
    """Schemathesis' stateful phase over the document's OpenAPI links (e.g. /tokenize -> /generate:
    the text just tokenized is generated from), every response checked as in the per-operation runs."""
    raw = load_document(document)
    config = schemathesis_config("http://127.0.0.1", documented_validation_statuses(raw), stateful=True)
    machine = schemathesis.openapi.from_dict(rewrap_event_streams(raw), config=config).as_state_machine()

    def test_links(live_server, live_settings):
        base_url = live_server + base_path_of(document, live_settings)

        class Workflow(machine):
            def get_call_kwargs(self, case):
                return {"base_url": base_url}

        Workflow.run(settings=hypothesis.settings(
            max_examples=STATEFUL_EXAMPLES, stateful_step_count=STATEFUL_STEPS, deadline=None,
            derandomize=True, database=None, suppress_health_check=list(hypothesis.HealthCheck)))

    return test_links


# test_tgi, test_lightllm, test_sensenova, ...: pytest collects one test per operation of each, and
# test_tgi_links, ...: the stateful phase of each document with links.
for _document in documents():
    _name = f"test_{_document.stem.replace('-', '_').replace('.', '_')}"
    globals()[_name] = _operation_tests(_document)
    if has_links(load_document(_document)):
        globals()[f"{_name}_links"] = _stateful_test(_document)


def test_every_document_is_mounted(live_settings):
    for document in documents():
        assert base_path_of(document, live_settings) is not None
