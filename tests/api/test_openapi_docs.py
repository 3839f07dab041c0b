"""The OpenAPI documents in openapi/: valid, loadable by Connexion, honest examples, TGI's API kept.

openapi/tgi.json is TGI's 2.1.2 document with its defects fixed (openapi/CHANGES.md); the upstream
documents it derives from are kept in openapi/upstream/ so these tests can compare against them.
"""

from __future__ import annotations

import json

import pytest
from connexion.json_schema import Draft4ResponseValidator
from openapi_spec_validator import validate as validate_spec
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from codegen.generate import SPEC_DIR
from codegen.validate import validation_errors
from tests.helpers.openapi import (
    HTTP_METHODS,
    documents,
    echo_app,
    media_types,
    oas30_validator,
    resolve,
    schema_nodes,
)

UPSTREAM_DIR = SPEC_DIR / "upstream"
TGI_PATH = SPEC_DIR / "tgi.json"
DOCS = documents()
TGI = DOCS["tgi.json"]
UPSTREAM_212 = json.loads((UPSTREAM_DIR / "tgi-2.1.2-dev0.openapi.json").read_text())
UPSTREAM_031 = json.loads((UPSTREAM_DIR / "tgi-0.3.1.openapi.json").read_text())
SCHEMAS = TGI["components"]["schemas"]


@pytest.fixture(scope="module")
def tgi_client():
    with echo_app(TGI_PATH).test_client() as client:
        yield client


# --- every document ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DOCS))
def test_document_is_valid_openapi(name):
    assert validation_errors(SPEC_DIR / name) == []


@pytest.mark.parametrize("name", sorted(DOCS))
def test_connexion_loads_document(name):
    app = echo_app(SPEC_DIR / name)
    assert app.middleware is not None


def test_upstream_tgi_document_is_what_we_fix():
    """The checks above have teeth: TGI's own document fails both."""
    with pytest.raises(OpenAPIValidationError):
        validate_spec(UPSTREAM_212)
    with pytest.raises(Exception, match="null|not of type|not valid"):
        echo_app(UPSTREAM_DIR / "tgi-2.1.2-dev0.openapi.json")


def example_failures(doc: dict) -> tuple[int, list[str]]:
    """(number of examples and defaults checked, those that do not match their schema)."""
    checked, failures = 0, []
    for where, schema in schema_nodes(doc):
        bare = {k: v for k, v in schema.items() if k not in ("example", "default")}
        for key in ("example", "default"):
            if key in schema:
                checked += 1
                for error in oas30_validator(doc, bare).iter_errors(schema[key]):
                    failures.append(f"{where} {key} {schema[key]!r}: {error.message}")
    for where, media in media_types(doc):
        examples = [media["example"]] if "example" in media else []
        examples += [resolve(doc, ex).get("value") for ex in media.get("examples", {}).values()]
        for example in examples:
            checked += 1
            for error in oas30_validator(doc, media.get("schema", {})).iter_errors(example):
                failures.append(f"{where} example {example!r}: {error.message}")
    return checked, failures


@pytest.mark.parametrize("name", sorted(DOCS))
def test_examples_and_defaults_match_their_schemas(name):
    """Schemathesis sends examples as they are; a wrong-typed example is a false failure."""
    checked, failures = example_failures(DOCS[name])
    assert failures == []
    assert checked > 0 or name != "tgi.json"


def test_example_check_finds_upstream_defects():
    _, failures = example_failures(UPSTREAM_212)
    text = "\n".join(failures)
    assert "FinishReason example 'Length'" in text
    assert "GenerateParameters/properties/seed default 'null'" in text
    assert "ChatRequest/properties/max_tokens example '32'" in text
    assert "POST /generate 422 application/json example" in text and "'error_type' is a required" in text


# --- tgi.json: the fixed defects -----------------------------------------------------------------

VALID_CHAT = {"messages": [{"role": "user", "content": "What is Deep Learning?"}]}
GENERATE_PATHS = ["/", "/generate", "/generate_stream", "/tokenize"]
NULLABLE_PARAMETERS = [
    name for name, prop in SCHEMAS["GenerateParameters"]["properties"].items()
    if prop.get("nullable") or {"nullable": True, "enum": [None]} in prop.get("anyOf", [])
]


def test_finish_reason_example_is_in_its_enum():
    finish_reason = SCHEMAS["FinishReason"]
    assert finish_reason["example"] in finish_reason["enum"]


def test_no_string_typed_defaults_on_non_string_fields():
    for where, schema in schema_nodes(TGI):
        if "default" in schema and schema.get("type") not in (None, "string"):
            assert not isinstance(schema["default"], str), where


def test_nullable_parameters_cover_the_upstream_ones():
    upstream = UPSTREAM_212["components"]["schemas"]["GenerateParameters"]["properties"]
    added = ["min_p"]  # our extensions of TGI's parameters (openapi/CHANGES.md)
    assert sorted(NULLABLE_PARAMETERS) == sorted([*added, *(n for n, p in upstream.items() if p.get("nullable"))])
    assert "grammar" in NULLABLE_PARAMETERS


@pytest.mark.parametrize("path", GENERATE_PATHS)
def test_null_accepted_on_every_nullable_generate_parameter(tgi_client, path):
    parameters = dict.fromkeys(NULLABLE_PARAMETERS)
    response = tgi_client.post(path, json={"inputs": "Hello", "parameters": parameters})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("grammar", "status"),
    [
        (None, 200),
        ({"type": "json", "value": {"type": "object"}}, 200),
        ({"type": "json", "value": '{"type": "object"}'}, 200),
        ({"type": "regex", "value": "[a-z]+"}, 200),
        ({"type": "regex", "value": 5}, 400),
        ({"type": "xml", "value": "x"}, 400),
        (5, 400),
        ("null", 400),
    ],
)
def test_grammar_field(tgi_client, grammar, status):
    response = tgi_client.post("/generate", json={"inputs": "Hi", "parameters": {"grammar": grammar}})
    assert response.status_code == status, response.text


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("response_format", None, 200),
        ("response_format", {"type": "json", "value": {"type": "object"}}, 200),
        ("response_format", {"type": "regex"}, 400),
        ("tool_choice", None, 200),
        ("tool_choice", "auto", 200),
        ("tool_choice", "get_weather", 200),
        ("tool_choice", {"function": {"name": "f"}}, 200),
        ("tool_choice", {"function": {}}, 400),
        ("tool_choice", {"name": "f"}, 400),
        ("tool_choice", 5, 400),
        ("tool_choice", ["f"], 400),
    ],
)
def test_chat_nullable_and_tool_choice_fields(tgi_client, field, value, status):
    response = tgi_client.post("/v1/chat/completions", json={**VALID_CHAT, field: value})
    assert response.status_code == status, response.text


@pytest.mark.parametrize(
    ("parameter", "value", "status"),
    [
        ("best_of", -1, 400),
        ("best_of", 0, 200),  # TGI generates once for best_of 0 (only best_of > 1 is checked)
        ("best_of", 1, 200),
        ("seed", 0, 200),  # TGI accepts seed 0 ...
        ("seed", -1, 400),
        ("top_n_tokens", 0, 200),  # ... and top_n_tokens 0
        ("temperature", 0, 400),
        ("temperature", 0.01, 200),
        ("repetition_penalty", 0, 400),
        ("top_k", 0, 400),
        ("top_k", 1, 200),
        ("top_p", 0, 400),
        ("top_p", 1, 200),
        ("typical_p", 0, 400),
        ("frequency_penalty", -2, 200),  # TGI: -2.0 <= frequency_penalty
        ("frequency_penalty", -2.5, 400),
        ("max_new_tokens", 0, 200),
    ],
)
def test_numeric_bounds(tgi_client, parameter, value, status):
    response = tgi_client.post("/generate", json={"inputs": "Hi", "parameters": {parameter: value}})
    assert response.status_code == status, response.text


def _response_validator(schema: dict) -> Draft4ResponseValidator:
    return Draft4ResponseValidator({**schema, "components": TGI["components"]})


TOKEN = {"id": 1, "text": "a", "logprob": -0.5, "special": False}


@pytest.mark.parametrize(
    ("schema_name", "instance"),
    [
        ("GenerateResponse", {"generated_text": "a", "details": None}),
        ("StreamResponse", {"index": 0, "token": TOKEN, "generated_text": None, "details": None}),
        ("StreamResponse", {"index": 0, "token": TOKEN, "details": {"finish_reason": "length",
                                                                      "generated_tokens": 1}}),
        ("ChatCompletionChoice", {"index": 0, "delta": {"role": "assistant", "content": "a"},
                                  "logprobs": None, "finish_reason": None}),
        ("ChatCompletionComplete", {"index": 0, "message": {"role": "assistant", "content": "a"},
                                    "logprobs": None, "finish_reason": "length"}),
    ],
)
def test_null_accepted_on_nullable_response_fields(schema_name, instance):
    validator = _response_validator({"$ref": f"#/components/schemas/{schema_name}"})
    assert [e.message for e in validator.iter_errors(instance)] == []
    broken = {**instance, "details" if "details" in instance else "logprobs": 5}
    assert list(validator.iter_errors(broken)), "the nullable field must still be type-checked"


def test_compat_generate_answers_a_list_or_a_stream():
    """TGI's POST / wraps the non-streaming GenerateResponse in a list."""
    content = TGI["paths"]["/"]["post"]["responses"]["200"]["content"]
    json_schema = content["application/json"]["schema"]
    assert json_schema == {"type": "array", "items": {"$ref": "#/components/schemas/GenerateResponse"}}
    assert content["text/event-stream"]["schema"] == {"$ref": "#/components/schemas/StreamResponse"}


@pytest.mark.parametrize("path", ["/", "/v1/chat/completions", "/v1/completions"])
def test_streaming_capable_operations_declare_json_and_sse(path):
    content = TGI["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/event-stream"}


def test_error_responses_declared():
    for path, item in TGI["paths"].items():
        op = item.get("post")
        if op is None:
            continue
        expected = {"422"} if path in ("/tokenize", "/chat_tokenize", "/detokenize") else {"422", "424", "429", "500"}
        assert expected <= set(op["responses"]), path
        for status in expected:
            for media in op["responses"][status]["content"].values():
                assert media["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
                assert media["example"]["error_type"]


# --- tgi.json keeps TGI's API --------------------------------------------------------------------


def _operations(doc: dict) -> dict[tuple[str, str], dict]:
    return {(path, m): op for path, item in doc["paths"].items() for m, op in item.items() if m in HTTP_METHODS}


ADDED_OPERATIONS = {("/v1/models", "get"),  # TGI 2.2's route, listing LoRA adapters too (issue 13)
                    ("/chat_tokenize", "post"), ("/detokenize", "post")}  # TGI 3.x / vLLM (issue 25)


def test_same_operations_as_upstream_2_1_2():
    ours, upstream = _operations(TGI), _operations(UPSTREAM_212)
    assert set(ours) == set(upstream) | ADDED_OPERATIONS
    for key, op in upstream.items():
        assert ours[key]["operationId"] == op["operationId"], key
        assert ours[key].get("requestBody", {}).get("content", {}).keys() == \
            op.get("requestBody", {}).get("content", {}).keys(), key
        added = set(ours[key]["responses"]) - set(op["responses"])
        assert added == ({"422"} if key == ("/tokenize", "post") else set()), key
        assert set(op["responses"]) <= set(ours[key]["responses"]), key


# Additions for the OpenAI routes (issue 5), each recorded in openapi/CHANGES.md.
ADDED_SCHEMAS = {"StreamOptions", "LogitBias", "StopSequences", "JsonSchemaFormat", "ResponseFormat",
                 "CompletionLogprobs", "ChatCompletionStreamDelta",
                 "ModelInfo", "ModelsInfo",  # /v1/models (issue 13)
                 # chat tokenizing, reasoning, cached tokens (issue 25)
                 "ChatTokenizeResponse", "DetokenizeRequest", "DetokenizeResponse", "PromptTokensDetails"}
ADDED_FIELDS = {
    "ChatRequest": {"stream_options", "max_completion_tokens",
                    "chat_template_kwargs", "reasoning_effort", "parallel_tool_calls", "min_p"},  # issue 25
    "Message": {"tool_calls", "tool_call_id", "reasoning_content"},
    "CompletionRequest": {"n", "echo", "logprobs", "presence_penalty", "logit_bias", "stream_options", "min_p"},
    "GenerateParameters": {"min_p"}, "Usage": {"prompt_tokens_details"},  # issue 25
    "TextMessage": {"reasoning_content"}, "ToolCallMessage": {"reasoning_content", "content"},  # issue 25
    "ChatCompletion": {"object"}, "ChatCompletionChunk": {"object", "usage"},
    "Chunk": {"object", "usage"}, "CompletionFinal": {"object"},
    "FunctionDefinition": {"parameters"},
    "Info": {"adapters", "deterministic",  # LoRA adapters (issue 13), batch invariance (issue 24)
             "model_architecture", "supported_architectures",  # the paged path's families (issue 22)
             "kernels",  # the matmul path of GGUF layers (issue 36)
             "kv_cache_dtype",  # --kv-cache-dtype
             "model_kind"},  # generation or a pooling model (issue 39)
}
RELAXED_REQUIRED = {"Message": ["role"], "DeltaToolCall": ["index"], "FunctionDefinition": ["name"]}


def test_same_schemas_and_fields_as_upstream_2_1_2():
    upstream = UPSTREAM_212["components"]["schemas"]
    assert set(SCHEMAS) == set(upstream) | ADDED_SCHEMAS
    for name, schema in upstream.items():
        expected = set(schema.get("properties", {})) | ADDED_FIELDS.get(name, set())
        assert set(SCHEMAS[name].get("properties", {})) == expected, name
        assert SCHEMAS[name].get("required") == RELAXED_REQUIRED.get(name, schema.get("required")), name


# --- the 0.3.1 API is a subset -------------------------------------------------------------------

# 0.3.1's document lets `seed` be negative; its server (a u64) never accepted that, nor does ours.
NARROWED_SINCE_0_3_1 = {"GenerateRequest.parameters.seed": {"minimum"}}


def _lower(schema: dict) -> tuple[float, bool] | None:
    if "minimum" in schema:
        return schema["minimum"], schema.get("exclusiveMinimum") is True
    if isinstance(schema.get("exclusiveMinimum"), (int, float)) and schema["exclusiveMinimum"] is not True:
        return schema["exclusiveMinimum"], True  # 3.1-style numeric bound
    return None


def _upper(schema: dict) -> tuple[float, bool] | None:
    if "maximum" in schema:
        return schema["maximum"], schema.get("exclusiveMaximum") is True
    if isinstance(schema.get("exclusiveMaximum"), (int, float)) and schema["exclusiveMaximum"] is not True:
        return schema["exclusiveMaximum"], True
    return None


def _unwrap_nullable(doc: dict, schema: dict) -> tuple[dict, bool]:
    """(the non-null schema, whether null is accepted) for `nullable` and anyOf[X, null] forms."""
    schema = resolve(doc, schema)
    branches = schema.get("anyOf") or schema.get("oneOf")
    null_branch = {"nullable": True, "enum": [None]}
    if branches and null_branch in branches and len(branches) == 2:
        (inner,) = [b for b in branches if b != null_branch]
        return resolve(doc, inner), True
    return schema, bool(schema.get("nullable"))


def _bound_allows(new: tuple[float, bool] | None, old: tuple[float, bool] | None, lower: bool) -> bool:
    if new is None:
        return True
    if old is None:
        return False
    (new_value, new_excl), (old_value, old_excl) = new, old
    if new_value == old_value:
        return old_excl or not new_excl
    return new_value < old_value if lower else new_value > old_value


def _assert_accepts(old_doc, old, new_doc, new, where, problems):
    old, old_nullable = _unwrap_nullable(old_doc, old)
    new, new_nullable = _unwrap_nullable(new_doc, new)
    narrowed = NARROWED_SINCE_0_3_1.get(where, set())
    if old_nullable and not new_nullable:
        problems.append(f"{where}: null no longer accepted")
    old_type, new_type = old.get("type"), new.get("type")
    if old_type != new_type and not (old_type == "integer" and new_type == "number"):
        problems.append(f"{where}: type {old_type} -> {new_type}")
    if "minimum" not in narrowed and not _bound_allows(_lower(new), _lower(old), lower=True):
        problems.append(f"{where}: lower bound {_lower(old)} -> {_lower(new)}")
    if not _bound_allows(_upper(new), _upper(old), lower=False):
        problems.append(f"{where}: upper bound {_upper(old)} -> {_upper(new)}")
    if "maxItems" in new and new["maxItems"] < old.get("maxItems", float("inf")):
        problems.append(f"{where}: maxItems {old.get('maxItems')} -> {new['maxItems']}")
    if "enum" in new and not set(old.get("enum", [])) <= set(new["enum"]):
        problems.append(f"{where}: enum {old.get('enum')} -> {new['enum']}")
    if not set(new.get("required", [])) <= set(old.get("required", [])):
        problems.append(f"{where}: newly required {set(new['required']) - set(old.get('required', []))}")
    for prop, old_prop in old.get("properties", {}).items():
        if prop not in new.get("properties", {}):
            problems.append(f"{where}.{prop}: removed")
            continue
        _assert_accepts(old_doc, old_prop, new_doc, new["properties"][prop], f"{where}.{prop}", problems)
    if "items" in old:
        _assert_accepts(old_doc, old["items"], new_doc, new.get("items", {}), f"{where}[]", problems)


def resolve_name(schema: dict) -> str | None:
    ref = schema.get("$ref", "")
    return ref.rsplit("/", 1)[-1] if ref else None


def _request_schemas(doc: dict) -> dict[tuple[str, str], dict]:
    return {
        key: op["requestBody"]["content"]["application/json"]["schema"]
        for key, op in _operations(doc).items()
        if "requestBody" in op
    }


def test_0_3_1_operations_are_kept():
    ours = _operations(TGI)
    for key, op in _operations(UPSTREAM_031).items():
        assert key in ours, key
        assert ours[key]["operationId"] == op["operationId"]
        assert set(op["responses"]) <= set(ours[key]["responses"]), key
        for ctype in op["responses"]["200"].get("content", {}):
            assert ctype in ours[key]["responses"]["200"]["content"], key


def test_0_3_1_request_fields_are_accepted():
    ours = _request_schemas(TGI)
    problems: list[str] = []
    for key, old in _request_schemas(UPSTREAM_031).items():
        new = ours[key]
        _assert_accepts(UPSTREAM_031, old, TGI, new, resolve_name(old) or str(key), problems)
    assert problems == []


def test_0_3_1_comparison_has_teeth():
    """A narrowed copy of our document is reported."""
    narrowed = json.loads(json.dumps(TGI))
    params = narrowed["components"]["schemas"]["GenerateParameters"]["properties"]
    params["stop"]["maxItems"] = 2
    params["top_k"]["nullable"] = False
    del params["do_sample"]
    problems: list[str] = []
    for key, old in _request_schemas(UPSTREAM_031).items():
        _assert_accepts(UPSTREAM_031, old, narrowed, _request_schemas(narrowed)[key], str(key), problems)
    text = "\n".join(problems)
    assert "stop: maxItems" in text and "top_k: null" in text and "do_sample: removed" in text


def _requests_0_3_1() -> list[dict]:
    """Requests a 0.3.1 client sends: every field, and each parameter at its 0.3.1 limits."""
    everything = {
        "details": True, "do_sample": True, "max_new_tokens": 20, "repetition_penalty": 1.03, "seed": 42,
        "stop": ["photographer"], "temperature": 0.5, "top_k": 10, "top_p": 0.95,
    }
    assert set(everything) == set(UPSTREAM_031["components"]["schemas"]["GenerateParameters"]["properties"])
    limits = [
        {"max_new_tokens": 1}, {"max_new_tokens": 511}, {"top_p": 1.0}, {"top_p": 1e-6},
        {"temperature": 1e-6}, {"repetition_penalty": 1e-6}, {"top_k": 1}, {"seed": 0},
        {"seed": 2**63 - 1}, {"stop": ["a", "b", "c", "d"]}, {"stop": []},
        {"repetition_penalty": None, "temperature": None, "top_k": None, "top_p": None},
    ]
    return [{"inputs": "My name is Olivier and I"}, {"inputs": "x", "parameters": {}},
            {"inputs": "x", "parameters": everything}] + [{"inputs": "x", "parameters": p} for p in limits]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("body", _requests_0_3_1(), ids=lambda b: json.dumps(b.get("parameters")))
def test_0_3_1_requests_accepted_by_connexion(tgi_client, path, body):
    old_schema = resolve(UPSTREAM_031, {"$ref": "#/components/schemas/GenerateRequest"})
    assert list(oas30_validator(UPSTREAM_031, _fix_031(old_schema)).iter_errors(body)) == []
    response = tgi_client.post(path, json=body)
    assert response.status_code == 200, response.text


def _fix_031(schema: dict) -> dict:
    """0.3.1's request schema in 3.0 form (numeric exclusive bounds), to check our samples against it."""
    fixed = json.loads(json.dumps(schema))
    params = json.loads(json.dumps(UPSTREAM_031["components"]["schemas"]["GenerateParameters"]))
    for prop in params["properties"].values():
        prop.pop("default", None)
        for key, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(prop.get(key), float):
                prop[flag] = prop.pop(key)
                prop[key] = True
    fixed["properties"]["parameters"] = params
    return fixed
