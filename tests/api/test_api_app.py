"""The app factory: dialect mounts, operationId resolution, per-dialect error shapes, lifespan, state."""

from __future__ import annotations

import json

import pytest

from opentgi.api import runtime
from opentgi.api.app import DIALECTS, create_app, mounts_for
from opentgi.api.engine_client import EngineClient
from opentgi.config import Settings
from opentgi.schemas import spec_path
from tests.helpers.fake_engine import FakeEngine


def test_the_fake_and_the_engine_implement_the_engine_client():
    from opentgi.engine.engine import Engine

    assert isinstance(FakeEngine(), EngineClient)
    names = [n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")]
    assert "submit" in names and "chat_template" in names
    missing = [name for name in names if not hasattr(Engine, name)]
    assert missing == []


def test_mounts_follow_settings_api():
    def mounts(api):
        return {(m.dialect.name, m.base_path) for m in mounts_for(Settings(api=api))}

    tgi_root = mounts("tgi")
    assert ("tgi", "") in tgi_root and ("lightllm", "/lightllm") in tgi_root
    assert ("tgi", "/tgi") not in tgi_root
    lightllm_root = mounts("lightllm")
    assert ("lightllm", "") in lightllm_root and ("tgi", "/tgi") in lightllm_root
    with pytest.raises(ValueError, match="unknown api"):
        mounts_for(Settings(api="vllm"))


def test_every_dialect_document_is_packaged():
    for dialect in DIALECTS:
        assert spec_path(dialect.document).is_file()


def test_lifespan_starts_and_stops_the_engine():
    engine = FakeEngine()
    with create_app(Settings(), engine).test_client() as client:
        assert engine.started and not engine.stopped
        assert client.get("/info").json()["model_id"] == "fake/model"
    assert engine.stopped


def test_two_apps_each_see_their_own_engine():
    first, second = FakeEngine(), FakeEngine()
    second.info.model_id = "other/model"
    with create_app(Settings(), first).test_client() as a, create_app(Settings(), second).test_client() as b:
        assert a.get("/info").json()["model_id"] == "fake/model"
        assert b.get("/info").json()["model_id"] == "other/model"
    with pytest.raises(RuntimeError, match="no opentgi app"):
        runtime.engine()


def test_lightllm_at_the_root_moves_tgi_under_its_prefix():
    with create_app(Settings(api="lightllm"), FakeEngine()).test_client() as client:
        assert client.get("/tgi/info").json()["router"] == "opentgi"
        # validation errors in each dialect's own shape
        tgi = client.post("/tgi/generate", json={"inputs": "x", "parameters": {"temperature": 0}})
        assert tgi.status_code == 422
        assert tgi.json() == {"error": "Input validation error: `temperature` must be strictly positive",
                              "error_type": "validation"}
        lightllm = client.post("/generate", json={"inputs": 5})
        assert lightllm.status_code == 400 and set(lightllm.json()) == {"message"}


def test_tgi_at_the_root_and_lightllm_under_its_prefix():
    with create_app(Settings(), FakeEngine()).test_client() as client:
        assert client.get("/info").status_code == 200
        response = client.post("/lightllm/generate", json={"inputs": 5})
        assert response.status_code == 400 and set(response.json()) == {"message"}
        assert client.get("/lightllm/docs/").status_code == 200
        assert client.get("/docs/").status_code == 200
        assert client.get("/openapi.json").json()["info"]["title"] == "Text Generation Inference"


def test_routing_errors_in_tgi_shape():
    with create_app(Settings(), FakeEngine()).test_client() as client:
        missing = client.get("/nowhere")
        assert missing.status_code == 404
        assert missing.json() == {"error": "Not Found", "error_type": "not_found"}
        wrong = client.put("/generate", json={"inputs": "x"})
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error_type"] == "method_not_allowed"


def test_operation_ids_resolve_to_dialect_modules():
    import opentgi.api.tgi.handlers as tgi

    document = json.loads(spec_path("tgi.json").read_text())
    for path_item in document["paths"].values():
        for operation in path_item.values():
            assert callable(getattr(tgi, operation["operationId"])), operation["operationId"]
