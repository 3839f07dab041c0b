"""--tenants on the real app, with a fake engine that generates: keys and admin routes (401/403 in
each dialect's shape), quotas (429 + Retry-After, other tenants unaffected), usage and metrics per
tenant, the tenant on the engine request and in the log line."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import httpx
import pytest
import pytest_asyncio

from opentgi.api.app import create_app
from opentgi.api.tenants.ledger import TenantLedger, reload_on_sighup
from opentgi.config import Settings
from opentgi.engine.errors import AdapterInUseError
from opentgi.engine.events import GenerationResult, SequenceResult, Timings, TokenEvent
from opentgi.engine.handle import RequestHandle
from opentgi.engine.info import ChatTemplate
from opentgi.engine.request import FinishReason
from opentgi.metrics import Metrics
from tests.helpers.fake_engine import FakeEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

TENANTS = """\
tenants:
  - name: alpha
    keys: [sk-alpha-1, sk-alpha-2]
    weight: 2
  - name: beta
    keys: [sk-beta]
    max_concurrent_requests: 1
  - name: gamma
    keys: [sk-gamma]
    tokens_per_minute: 20
  - name: ops
    keys: [sk-ops]
    admin: true
"""
ALPHA, BETA, GAMMA, OPS = ({"Authorization": f"Bearer {k}"} for k in ("sk-alpha-2", "sk-beta", "sk-gamma", "sk-ops"))


class GeneratingEngine(FakeEngine):
    """Text is one token per character; a request generates max_new_tokens tokens, at once or, while
    `hold` is set, once it is cleared."""

    def __init__(self):
        super().__init__()
        self.submitted = []
        self.hold: asyncio.Event | None = None

    async def submit(self, request):
        self.submitted.append(request)
        handle = RequestHandle(request, lambda _request_id: None)
        asyncio.get_running_loop().create_task(self._finish(handle))
        return handle

    async def load_adapter(self, name, path):
        if path == "/nowhere":
            await super().load_adapter(name, path)
        self.info.adapters.append(name)

    async def unload_adapter(self, name):
        if name == "busy":
            raise AdapterInUseError(f"adapter {name!r} is in use by 1 requests in flight")
        self.info.adapters.remove(name)

    def chat_template(self):
        return ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    async def _finish(self, handle):
        if self.hold is not None:
            await self.hold.wait()
        request = handle.request
        n = request.stopping.max_new_tokens
        events = [TokenEvent(index=0, token_id=5, token_text="A", logprob=-0.5, special=False, text_delta="A",
                             generated_tokens=i + 1, finish_reason=FinishReason.LENGTH if i == n - 1 else None)
                  for i in range(n)]
        result = GenerationResult(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            sequences=[SequenceResult(0, [5] * n, "A" * n, FinishReason.LENGTH, None, events)],
            timings=Timings(queued_at=1.0, scheduled_at=1.25, first_token_at=1.5, finished_at=2.0))
        handle._deliver(events, result, None)


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    return str(path)


@pytest.fixture(scope="module")
def app_and_engine(tenants_file):
    engine = GeneratingEngine()
    return create_app(Settings(tenants_file=tenants_file), engine), engine


@pytest_asyncio.fixture(loop_scope="session")
async def served(app_and_engine):
    """The module's app with fresh quotas, usage and metrics: (client, engine)."""
    app, engine = app_and_engine
    state = app.server_state
    state.metrics = Metrics()
    state.tenants = TenantLedger(state.tenants.table, state.metrics)
    engine.submitted.clear()
    engine.hold = None
    engine.info.adapters.clear()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client, engine


def generate(client, headers, inputs="hello", max_new_tokens=3):
    return client.post("/generate", headers=headers,
                       json={"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens}})


ROUTES = [  # (method, path, body, the dialect's error body for a message)
    ("POST", "/generate", {"inputs": "hi"}, lambda m, t: {"error": m, "error_type": t}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
     lambda m, t: {"error": m, "error_type": t}),
    ("POST", "/lightllm/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
     lambda m, t: {"message": m}),
    ("POST", "/v1/llm/completions", {"prompt": "hi", "model": "m", "max_new_tokens": 2},
     lambda m, t: {"error": {"code": {"unauthorized": 16, "overloaded": 8}[t], "message": m, "details": []}}),
    ("POST", "/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
     lambda m, t: {"type": "error", "error": {"type": {"unauthorized": "authentication_error",
                                                        "overloaded": "rate_limit_error"}[t], "message": m}}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2},
     lambda m, t: {"error": {"message": m, "param": None,
                             **{"unauthorized": {"type": "authentication_error", "code": "invalid_api_key"},
                                "overloaded": {"type": "rate_limit_error", "code": "rate_limit_exceeded"}}[t]}}),
]
UNAUTHORIZED = "Unauthorized: missing or invalid bearer token"


@pytest.mark.parametrize("method, path, body, shape", ROUTES, ids=[r[1] for r in ROUTES])
async def test_unknown_keys_get_401_and_tenant_keys_pass(served, method, path, body, shape):
    client, engine = served
    for headers in ({}, {"Authorization": "Bearer sk-nobody"}, {"x-api-key": "sk-alpha"}):
        response = await client.request(method, path, json=body, headers=headers)
        assert response.status_code == 401
        assert response.json() == shape(UNAUTHORIZED, "unauthorized")
    for headers in (ALPHA, {"x-api-key": "sk-alpha-1", "anthropic-version": "2023-06-01"}):
        response = await client.request(method, path, json=body, headers=headers)
        assert response.status_code == 200, response.text
    # the engine learns the tenant and its weight from the engine request
    assert {(r.tenant, r.tenant_weight) for r in engine.submitted} == {("alpha", 2.0)}


async def test_health_stays_open_and_admin_routes_need_an_admin_key(served):
    client, _ = served
    for path in ("/health", "/healthz"):
        assert (await client.get(path)).status_code == 200
    for path in ("/v1/usage", "/metrics"):
        assert (await client.get(path)).status_code == 401
        forbidden = await client.get(path, headers=ALPHA)
        assert forbidden.status_code == 403
        assert forbidden.json() == {"error": "Forbidden: this route needs an admin key", "error_type": "forbidden"}
        assert (await client.get(path, headers=OPS)).status_code == 200


@pytest.mark.parametrize("method, path, body, shape", ROUTES, ids=[r[1] for r in ROUTES])
async def test_max_concurrent_requests_429_in_the_dialect_shape(served, method, path, body, shape):
    client, engine = served
    engine.hold = asyncio.Event()
    first = asyncio.ensure_future(client.request(method, path, json=body, headers=BETA))
    for _ in range(100):  # until beta's first request is in flight
        await asyncio.sleep(0.01)
        if engine.submitted:
            break
    refused = await client.request(method, path, json=body, headers=BETA)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    message = "tenant 'beta' has reached its max_concurrent_requests (1 in flight)"
    assert refused.json() == shape(message, "overloaded")
    other = asyncio.ensure_future(client.request(method, path, json=body, headers=ALPHA))
    await asyncio.sleep(0.05)
    engine.hold.set()
    assert (await first).status_code == 200 and (await other).status_code == 200  # alpha unaffected
    assert (await client.request(method, path, json=body, headers=BETA)).status_code == 200  # slot free again


async def test_tokens_per_minute_then_usage_and_metrics_match(served, caplog):
    client, _ = served
    caplog.set_level(logging.INFO, logger="opentgi.request")
    assert (await generate(client, GAMMA, "hello", 8)).status_code == 200  # 5 + 8 tokens
    assert (await generate(client, GAMMA, "hi", 8)).status_code == 200  # 2 + 8: 23 in the minute
    refused = await generate(client, GAMMA)
    assert refused.status_code == 429
    assert 55 <= int(refused.headers["retry-after"]) <= 60
    assert refused.json() == {"error": "tenant 'gamma' used 23 tokens in the last minute, its limit is 20 "
                                       "(tokens_per_minute)", "error_type": "overloaded"}
    stream = await client.post("/generate_stream", headers=GAMMA, json={"inputs": "x"})
    assert stream.status_code == 429 and stream.headers["retry-after"]  # a plain 429, never a stream
    assert (await generate(client, ALPHA, "abc", 4)).status_code == 200  # alpha unaffected
    usage = (await client.get("/v1/usage", headers=OPS)).json()
    assert usage["window_seconds"] == 60
    by_name = {t["name"]: t for t in usage["tenants"]}
    assert list(by_name) == ["alpha", "beta", "gamma", "ops"]
    assert by_name["gamma"] == {"name": "gamma", "requests": 2, "prompt_tokens": 7, "generated_tokens": 16,
                                "total_tokens": 23, "rejected": {"tokens_per_minute": 2,
                                                                 "max_concurrent_requests": 0},
                                "in_flight": 0, "tokens_last_minute": 23}
    assert (by_name["alpha"]["requests"], by_name["alpha"]["total_tokens"]) == (1, 7)
    metrics = (await client.get("/metrics", headers=OPS)).text
    for line in ('opentgi_tenant_requests_total{tenant="gamma"} 2', 'opentgi_tenant_prompt_tokens_total{tenant="gamma"} 7',
                 'opentgi_tenant_generated_tokens_total{tenant="gamma"} 16',
                 'opentgi_tenant_rejections_total{tenant="gamma",reason="tokens_per_minute"} 2',
                 'opentgi_tenant_queue_duration_count{tenant="alpha"} 1'):
        assert line in metrics, line
    lines = [r.getMessage() for r in caplog.records if r.name == "opentgi.request"]
    assert any("tenant=gamma" in line and "status=429" in line for line in lines)
    assert not any("sk-" in line for line in lines)  # the tenant, never the key


async def test_api_key_is_one_admin_tenant():
    engine = GeneratingEngine()
    app = create_app(Settings(api_key="k1,k2"), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await generate(client, {"Authorization": "Bearer k2"})).status_code == 200
        usage = (await client.get("/v1/usage", headers={"x-api-key": "k1"})).json()
        assert [(t["name"], t["requests"]) for t in usage["tenants"]] == [("default", 1)]
        assert (await client.get("/metrics", headers={"Authorization": "Bearer k1"})).status_code == 200
    assert engine.submitted[0].tenant == "default"


async def test_sighup_reloads_the_file_and_requests_in_flight_finish(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    engine = GeneratingEngine()
    app = create_app(Settings(tenants_file=str(path)), engine)
    ledger = app.server_state.tenants
    previous = reload_on_sighup(ledger, str(path))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            engine.hold = asyncio.Event()
            in_flight = asyncio.ensure_future(generate(client, BETA))
            while not engine.submitted:
                await asyncio.sleep(0.01)
            path.write_text(TENANTS.replace("[sk-alpha-1, sk-alpha-2]", "[sk-alpha-3]")
                            .replace("max_concurrent_requests: 1", "max_concurrent_requests: 2"))
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if ledger.table.find(b"sk-alpha-3") is not None:
                    break
            assert (await generate(client, ALPHA)).status_code == 401  # the old key is gone
            second = asyncio.ensure_future(generate(client, BETA))  # beta has a second slot now
            while len(engine.submitted) < 2 and not second.done():
                await asyncio.sleep(0.01)
            assert not second.done()  # in flight beside the first, not refused
            path.write_text("tenants: [")  # a broken file: the tenants stay as they are
            assert not ledger.reload(str(path))
            assert ledger.table.find(b"sk-alpha-3").name == "alpha"
            engine.hold.set()
            assert (await in_flight).status_code == 200 and (await second).status_code == 200
            usage = {t["name"]: t for t in (await client.get("/v1/usage", headers=OPS)).json()["tenants"]}
            assert (usage["beta"]["requests"], usage["beta"]["in_flight"]) == (2, 0)
    finally:
        signal.signal(signal.SIGHUP, previous)


async def test_adapter_routes_are_admin_only_and_answer_as_vllm(served):
    client, engine = served
    body = {"lora_name": "sql", "lora_path": "/nowhere"}
    assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 401
    assert (await client.post("/v1/load_lora_adapter", json=body, headers=ALPHA)).status_code == 403
    refused = await client.post("/v1/load_lora_adapter", json=body, headers=OPS)  # the fake serves none
    assert refused.status_code == 400
    assert refused.json() == {"error": "LoRA adapters are served on the paged path only", "error_type": "validation"}
    missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=OPS)
    assert missing.status_code == 404 and missing.json()["error"] == "adapter 'sql' is not loaded"
    assert (await client.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=OPS)).status_code == 422
    for name in ("sql", "busy"):
        loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/a"}, headers=OPS)
        assert loaded.status_code == 200 and loaded.text == f"Success: LoRA adapter '{name}' added successfully."
    models = (await client.get("/v1/models", headers=ALPHA)).json()
    assert [m["id"] for m in models["data"]] == ["fake/model", "sql", "busy"]
    busy = await client.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}, headers=OPS)
    assert busy.status_code == 409 and busy.json()["error"].startswith("adapter 'busy' is in use")
    unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=OPS)
    assert unloaded.status_code == 200 and engine.info.adapters == ["busy"]
