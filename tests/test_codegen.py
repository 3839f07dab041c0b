"""codegen/: generated models are fresh (CI fails on a stale spec), reproducible and generic."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import shutil
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from codegen import generate
from codegen.generate import SCHEMAS_DIR, SPEC_DIR, find_documents, stale_files, write
from codegen.validate import main as validate_main

SAMPLE_YAML = """\
openapi: 3.0.3
info: {title: Sample, version: "1"}
paths:
  /echo:
    post:
      operationId: sample.echo
      requestBody:
        required: true
        content:
          application/json:
            schema: {$ref: '#/components/schemas/EchoRequest'}
      responses:
        "200":
          description: ok
          content:
            application/json:
              schema: {$ref: '#/components/schemas/EchoResponse'}
components:
  schemas:
    EchoRequest:
      type: object
      required: [text]
      properties:
        text: {type: string}
        times: {type: integer, minimum: 1, nullable: true, default: null}
    EchoResponse:
      type: object
      required: [texts]
      properties:
        texts: {type: array, items: {type: string}}
"""


def _copy_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of openapi/ and of the generated schemas/, to modify freely."""
    spec_dir = tmp_path / "openapi"
    schemas_dir = tmp_path / "schemas"
    spec_dir.mkdir()
    for doc in find_documents():
        shutil.copy(doc.path, spec_dir / doc.path.name)
    shutil.copytree(SCHEMAS_DIR, schemas_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return spec_dir, schemas_dir


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


@pytest.mark.slow  # the ci tier: a long run
def test_generated_code_is_fresh():
    """`python -m codegen` was run and committed after the last change to openapi/."""
    assert stale_files() == []


def test_every_document_has_its_module_and_copy():
    for doc in find_documents():
        assert (SCHEMAS_DIR / f"{doc.module_name}.py").is_file()
        assert (SCHEMAS_DIR / "openapi" / doc.path.name).read_bytes() == doc.path.read_bytes()


@pytest.mark.slow  # regenerates every document twice
def test_modified_spec_is_detected_as_stale(tmp_path):
    spec_dir, schemas_dir = _copy_tree(tmp_path)
    assert stale_files(schemas_dir, spec_dir) == []
    tgi = spec_dir / "tgi.json"
    tgi.write_text(tgi.read_text().replace('"My name is Olivier and I"', '"My name is Ada and I"', 1))
    assert stale_files(schemas_dir, spec_dir) == ["stale: openapi/tgi.json", "stale: tgi.py"]


@pytest.mark.slow  # regenerates every document twice
def test_missing_and_extra_files_are_reported(tmp_path):
    spec_dir, schemas_dir = _copy_tree(tmp_path)
    (spec_dir / "sample.yaml").write_text(SAMPLE_YAML)
    (schemas_dir / "tgi.py").unlink()
    (schemas_dir / "old_dialect.py").write_text("# a document that was removed\n")
    assert stale_files(schemas_dir, spec_dir) == [
        "extra (no document generates it): old_dialect.py",
        "missing: openapi/sample.yaml",
        "missing: sample.py",
        "missing: tgi.py",
    ]
    changes = write(schemas_dir, spec_dir)
    assert "removed old_dialect.py" in changes and "wrote sample.py" in changes
    assert stale_files(schemas_dir, spec_dir) == []
    assert (schemas_dir / "__init__.py").read_bytes() == (SCHEMAS_DIR / "__init__.py").read_bytes()


def test_a_new_yaml_document_is_generated_without_changes_to_codegen(tmp_path):
    spec_dir, schemas_dir = tmp_path / "openapi", tmp_path / "schemas"
    spec_dir.mkdir()
    schemas_dir.mkdir()
    (spec_dir / "sample.yaml").write_text(SAMPLE_YAML)
    write(schemas_dir, spec_dir)
    assert (schemas_dir / "openapi" / "sample.yaml").read_text() == SAMPLE_YAML
    source = (schemas_dir / "sample.py").read_text()
    assert source.startswith("# GENERATED from openapi/sample.yaml")
    assert str(tmp_path) not in source
    sample = _import_file(schemas_dir / "sample.py", "generated_sample")
    request = sample.EchoRequest.model_validate({"text": "hi", "times": None})
    assert request.times is None
    with pytest.raises(ValueError):
        sample.EchoRequest.model_validate({"text": "hi", "times": 0})
    assert sample.EchoResponse(texts=["a"]).texts == ["a"]


@pytest.mark.slow  # the ci tier: a long run
def test_output_does_not_depend_on_the_checkout_location(tmp_path, monkeypatch):
    outputs = []
    for place in ("a", "somewhere/else"):
        monkeypatch.setattr(generate, "_generated", {})  # each place runs the generator itself
        spec_dir, schemas_dir = tmp_path / place / "openapi", tmp_path / place / "schemas"
        spec_dir.mkdir(parents=True)
        schemas_dir.mkdir()
        shutil.copy(SPEC_DIR / "tgi.json", spec_dir / "tgi.json")
        write(schemas_dir, spec_dir)
        outputs.append((schemas_dir / "tgi.py").read_bytes())
    assert outputs[0] == outputs[1] == (SCHEMAS_DIR / "tgi.py").read_bytes()
    assert b"/work/" not in outputs[0] and str(tmp_path).encode() not in outputs[0]


def test_generated_header_says_where_from_and_how_to_regenerate():
    for doc in find_documents():
        head = (SCHEMAS_DIR / f"{doc.module_name}.py").read_text().splitlines()[:3]
        assert head[0].startswith(f"# GENERATED from openapi/{doc.path.name} (sha256 ")
        assert "DO NOT EDIT BY HAND" in head[1] and "python -m codegen" in head[2]


def _models(module) -> list[type[BaseModel]]:
    return [obj for _, obj in inspect.getmembers(module, inspect.isclass)
            if issubclass(obj, BaseModel) and obj.__module__ == module.__name__]


@pytest.mark.parametrize("doc", find_documents(), ids=lambda d: d.path.name)
def test_no_model_defaults_to_a_string_null(doc):
    module = importlib.import_module(f"opentgi.schemas.{doc.module_name}")
    defaults = [(m.__name__, name, f.default) for m in _models(module) for name, f in m.model_fields.items()]
    assert defaults, "the module defines models"
    assert [d for d in defaults if d[2] in ("null", "false", "true")] == []


def test_tgi_models_have_tgi_defaults_and_types():
    from opentgi.schemas import tgi

    params = tgi.GenerateParameters()
    assert params.seed is None and params.grammar is None and params.best_of is None
    assert (params.details, params.decoder_input_details, params.do_sample, params.watermark) == (
        False, False, False, False)
    assert params.max_new_tokens == 100
    assert tgi.CompatGenerateRequest(inputs="x").stream is False
    grammar = tgi.GenerateParameters.model_validate({"grammar": {"type": "regex", "value": "a+"}}).grammar
    assert isinstance(grammar, tgi.RegexGrammar)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    choice = tgi.ChatRequest.model_validate({**chat, "tool_choice": {"function": {"name": "f"}}}).tool_choice
    assert isinstance(choice, tgi.FunctionChoice) and choice.function.name == "f"
    assert tgi.ChatRequest.model_validate({**chat, "tool_choice": "auto"}).tool_choice == "auto"
    assert tgi.ChatRequest.model_validate(chat).tool_choice is None
    assert tgi.GenerateResponse(generated_text="a").details is None
    with pytest.raises(ValueError):
        tgi.GenerateParameters(best_of=-1)


def test_spec_path_serves_the_packaged_documents():
    from opentgi.schemas import spec_path

    assert spec_path("tgi") == spec_path("tgi.json")
    assert spec_path("tgi").read_bytes() == (SPEC_DIR / "tgi.json").read_bytes()
    with pytest.raises(FileNotFoundError, match="no OpenAPI document 'nope'"):
        spec_path("nope")


def test_validate_reports_an_invalid_document(capsys):
    upstream = SPEC_DIR / "upstream" / "tgi-2.1.2-dev0.openapi.json"
    assert validate_main([str(upstream)]) == 1
    assert "tgi-2.1.2-dev0.openapi.json" in capsys.readouterr().err
    assert validate_main([]) == 0
