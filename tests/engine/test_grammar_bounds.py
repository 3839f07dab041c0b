"""Bounded grammar work: size and depth limits first (a clear 422), schema checks off the event loop,
a compile timeout, a queued compile dropped when its last waiter leaves, compiling requests counted
against --max-concurrent-requests, the normalised-schema cache keyed by a hash with a size cap."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from opentgi.config import Settings
from opentgi.engine.errors import GrammarError, OverloadedError
from opentgi.engine.request import GenerationRequest, GrammarSpec, SamplingParams, StoppingParams
from opentgi.engine.sampling import grammar
from opentgi.engine.sampling.grammar import GrammarCompiler
from opentgi.engine.sampling.grammar_bounds import MAX_SCHEMA_DEPTH, check_bounds

HUGE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json", HUGE_SCHEMA), "20000 properties; at most 256"),
    (GrammarSpec("json", {"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(100)}} for j in range(20)}}), "more than 2000 nodes"),
    (GrammarSpec("json", json.dumps(HUGE_SCHEMA)), "at most 64000 are allowed"),
    (GrammarSpec("json", deep_schema(MAX_SCHEMA_DEPTH)), "levels deep"),
    (GrammarSpec("regex", "a" * 5000), "at most 4000"),
    (GrammarSpec("regex", "(ab){5,100000}"), "repetition bound"),
])
def test_bounds_are_checked_first_with_a_clear_message(spec, words):
    began = time.perf_counter()
    with pytest.raises(GrammarError, match=words):
        check_bounds(spec)
    assert time.perf_counter() - began < 0.5


def test_usual_grammars_are_within_bounds():
    check_bounds(GrammarSpec("json", deep_schema(8)))
    check_bounds(GrammarSpec("regex", r"\d{3}-\d{4}"))


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), eos_token_ids=[2], max_workers=1)
    yield c
    c.close()


def block_worker(c: GrammarCompiler, seconds: float) -> threading.Event:
    """Keeps the compiler's one worker busy; returns an event that frees it early."""
    release = threading.Event()
    c._executor.submit(release.wait, seconds)
    return release


async def test_a_compile_past_its_timeout_is_a_422(compiler):
    release = block_worker(compiler, 5)
    try:
        spec = GrammarSpec("json", {"type": "object", "properties": {"timeout_case": {"type": "integer"}}})
        with pytest.raises(GrammarError, match="took longer than 0.2 s to compile"):
            await compiler.compile(spec, timeout_s=0.2)
    finally:
        release.set()


async def test_a_queued_compile_is_dropped_when_its_last_waiter_leaves(compiler):
    release = block_worker(compiler, 5)
    try:
        spec = GrammarSpec("json", {"type": "object", "properties": {"leaving_case": {"type": "integer"}}})
        first = asyncio.create_task(compiler.compile(spec))
        second = asyncio.create_task(compiler.compile(spec))
        await asyncio.sleep(0.2)
        (key, future), = [(k, f) for k, f in compiler._cache.items() if "leaving_case" in k[1]]
        first.cancel()
        await asyncio.sleep(0.05)
        assert not future.cancelled()  # another request still waits for it
        second.cancel()
        await asyncio.sleep(0.05)
        assert future.cancelled() and key not in compiler._cache
    finally:
        release.set()


async def test_schema_checks_run_off_the_event_loop(compiler, monkeypatch):
    """The schema is parsed and checked against the meta-schema in a worker thread, not on the loop."""
    threads = []
    key_of = grammar.grammar_key

    def recording(spec):
        threads.append(threading.current_thread())
        return key_of(spec)

    monkeypatch.setattr(grammar, "grammar_key", recording)
    schema = {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(250)}}
    assert callable(await compiler.compile(GrammarSpec("json", schema)))
    assert threads and threading.current_thread() not in threads


def test_the_normalised_schema_cache_is_keyed_by_hash_and_capped():
    for i in range(grammar.NORMALISED_CACHE_SIZE + 20):
        grammar.grammar_key(GrammarSpec("json", {"type": "object", "properties": {f"k{i}": {"type": "null"}}}))
    assert len(grammar._normalised) == grammar.NORMALISED_CACHE_SIZE
    assert all(isinstance(k, bytes) and len(k) == 32 for k in grammar._normalised)


async def test_requests_compiling_their_grammar_count_against_the_limit(tiny_llama):
    from opentgi.engine.engine import Engine

    engine = Engine.from_settings(Settings(model_id=str(tiny_llama), device="cpu", max_batch_total_tokens=2048,
                                           max_concurrent_requests=1))
    await engine.start()
    try:
        engine._compile_grammar  # noqa: B018 - the compiler is made on first use
        started = asyncio.Event()
        release = asyncio.Event()

        async def slow_compile(request):
            started.set()
            await release.wait()
            return None

        engine._compile_grammar = slow_compile
        ask = GenerationRequest([1, 2, 3], SamplingParams(), StoppingParams(max_new_tokens=2),
                                grammar=GrammarSpec("regex", "[ab]+"))
        compiling = asyncio.create_task(engine.submit(ask))
        await started.wait()
        with pytest.raises(OverloadedError):
            await engine.submit(GenerationRequest([1, 2, 3], SamplingParams(), StoppingParams(max_new_tokens=2)))
        release.set()
        await (await compiling).result()
    finally:
        await engine.stop()


def test_a_huge_schema_is_a_quick_422_on_every_route():
    from opentgi.api.app import create_app
    from tests.helpers.fake_engine import FakeEngine

    with create_app(Settings(), FakeEngine()).test_client() as client:
        began = time.perf_counter()
        response = client.post("/generate", json={"inputs": "x", "parameters": {
            "grammar": {"type": "json", "value": HUGE_SCHEMA}}})
        assert response.status_code == 422 and "at most 256" in response.json()["error"]
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                              "response_format": {"type": "json", "value": HUGE_SCHEMA}})
        assert response.status_code == 422 and "at most 256" in response.json()["error"]
        assert time.perf_counter() - began < 5
