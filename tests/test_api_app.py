"""The app factory: dialect mounts, operationId resolution, per-dialect error shapes, lifespan, state."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from opentgi.api import runtime
from opentgi.api.app import DIALECTS, create_app, mounts_for
from opentgi.api.engine_client import EngineClient
from opentgi.config import Settings
from opentgi.engine.errors import OverloadedError
from opentgi.engine.info import ChatTemplate, EngineStats, TokenizedText
from opentgi.schemas import spec_path


@dataclass
class FakeInfo:
    model_id: str = "fake/model"
    model_sha: str | None = None
    model_dtype: str = "torch.float32"
    model_device_type: str = "cpu"
    pipeline_tag: str = "text-generation"
    max_input_tokens: int = 100
    max_total_tokens: int = 128
    max_batch_total_tokens: int = 4096
    eos_token_ids: list = field(default_factory=lambda: [0])
    vocab_size: int = 100
    adapters: list = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    supported_architectures: list = field(default_factory=lambda: ["LlamaForCausalLM"])


class FakeEngine:
    """The EngineClient protocol, for routes that never generate: text is one token per character."""

    def __init__(self):
        self.info = FakeInfo()
        self.started = self.stopped = False

    async def start(self):
        self.started = True

    async def stop(self):
        self.stopped = True

    async def encode(self, text, add_special_tokens=True, max_tokens=None):
        return [ord(c) % 100 for c in text]

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(chr(65 + i % 26) for i in token_ids)

    async def tokenize(self, text):
        return TokenizedText([ord(c) % 100 for c in text], [(i, i + 1) for i in range(len(text))])

    async def encode_fim(self, prefix, suffix, fim_template=None):
        return await self.encode(prefix + suffix)

    def chat_template(self):
        return ChatTemplate(None)

    async def submit(self, request):
        raise OverloadedError("Model is overloaded")

    def healthy(self):
        return True

    async def probe(self):
        return True

    def stats(self):
        return EngineStats(waiting=0, running=0, num_blocks=16, used_blocks=0, cached_blocks=0,
                           tokens_held_running=0, peak_tokens_running=0, preemptions_total=0,
                           prefix_hit_tokens=0, prefix_query_tokens=0, steps_total=0, last_step_at=0.0)


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
