"""Health that tells the truth: the watchdog fails requests in flight when the loop thread dies or a
step stalls, and new requests are refused at once; probes are not refused by a full server; a request
cancelled before the loop picks it up never runs; the KV gauges follow an abort at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from opentgi.config import Settings
from opentgi.engine.engine import Engine
from opentgi.engine.errors import UnhealthyError
from opentgi.engine.handle import RequestHandle
from opentgi.engine.observer import EngineObserver
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.request_state import RequestState


def long_request(max_new: int = 200) -> GenerationRequest:
    return GenerationRequest([1, 15, 27, 99], SamplingParams(), StoppingParams(max_new_tokens=max_new, ignore_eos=True))


async def started(llama, observer=None, **settings) -> Engine:
    engine = Engine(llama, Settings(max_batch_total_tokens=4096, **settings), observer=observer)
    await engine.start()
    return engine


class Die(BaseException):
    """Not an Exception: nothing in the loop catches it, so the loop thread ends."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it dies on purpose
async def test_a_dead_loop_thread_fails_requests_in_flight_and_refuses_new_ones(llama, monkeypatch):
    engine = await started(llama)
    try:
        handle = await engine.submit(long_request())
        await anext(aiter(handle))  # generating
        step = engine.core.step

        def dying_step():
            raise Die("boom")

        monkeypatch.setattr(engine.core, "step", dying_step)
        began = time.monotonic()
        with pytest.raises(UnhealthyError, match="the engine loop died"):
            await asyncio.wait_for(handle.result(), 10)
        assert time.monotonic() - began < 5
        assert not engine.healthy() and not await engine.probe()
        began = time.monotonic()
        with pytest.raises(UnhealthyError, match="died"):
            await engine.submit(long_request())
        assert time.monotonic() - began < 0.5  # at once, not after a timeout
        monkeypatch.setattr(engine.core, "step", step)
    finally:
        await engine.stop()


async def test_a_stalled_step_fails_requests_in_flight_and_refuses_new_ones(llama, monkeypatch):
    engine = await started(llama)
    engine.stall_after_s = 0.3
    engine.stall_per_token_s = 0.05  # a decode step's limit 0.35 s
    try:
        handle = await engine.submit(long_request())
        await anext(aiter(handle))
        execute = engine.runner.execute
        calls = []

        def slow_execute(*args, **kwargs):
            if not calls:
                calls.append(1)
                time.sleep(2.0)  # one step far past the (test's) stall limit
            return execute(*args, **kwargs)

        monkeypatch.setattr(engine.runner, "execute", slow_execute)
        began = time.monotonic()
        with pytest.raises(UnhealthyError, match="stalled"):
            await asyncio.wait_for(handle.result(), 10)
        assert time.monotonic() - began < 1.8  # failed while the step was still running
        assert not engine.healthy()
        with pytest.raises(UnhealthyError, match="stalled"):
            await engine.submit(long_request())
        # once the step ends the engine serves again, and the failed request's blocks are freed
        deadline = time.monotonic() + 10
        while not engine.healthy():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        result = await (await engine.submit(long_request(max_new=3))).result()
        assert result.sequences[0].generated_tokens == 3
        assert engine.stats().used_blocks == 0 and engine.stats().running == 0
    finally:
        await engine.stop()


async def test_a_step_of_many_prompt_tokens_has_time_in_proportion(llama, monkeypatch):
    engine = await started(llama)
    engine.stall_after_s = 0.3
    engine.stall_per_token_s = 0.05  # a 60-token prompt step may take 3.3 s, a decode step 0.35 s
    try:
        execute = engine.runner.execute
        calls = []

        def slow_prompt_step(*args, **kwargs):
            if not calls:
                calls.append(1)
                time.sleep(1.5)  # past the base limit, within the prompt's allowance
            return execute(*args, **kwargs)

        monkeypatch.setattr(engine.runner, "execute", slow_prompt_step)
        prompt = list(range(10, 70))
        request = GenerationRequest(prompt, SamplingParams(), StoppingParams(max_new_tokens=4, ignore_eos=True))
        result = await asyncio.wait_for((await engine.submit(request)).result(), 20)
        assert result.sequences[0].generated_tokens == 4
        assert calls and engine.healthy()
    finally:
        await engine.stop()


async def test_a_probe_is_not_refused_by_a_full_server(llama):
    engine = await started(llama, max_concurrent_requests=1)
    try:
        handle = await engine.submit(long_request())
        await anext(aiter(handle))
        assert await engine.probe(timeout_s=30)
        handle.cancel()
        # idle again: the probe runs a generation (still outside the limit)
        deadline = time.monotonic() + 10
        while engine.stats().running:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        other = await engine.submit(long_request(max_new=2))
        assert await engine.probe(timeout_s=30)
        await other.result()
    finally:
        await engine.stop()


class Gauges(EngineObserver):
    def __init__(self):
        self.kv_used: list[int] = []

    def on_kv_blocks(self, *, used, free, cached):
        self.kv_used.append(used)


async def test_a_request_cancelled_before_the_loop_picks_it_up_never_runs(llama):
    gauges = Gauges()
    engine = Engine(llama, Settings(max_batch_total_tokens=4096), observer=gauges)  # no loop thread
    request = long_request()
    handle = RequestHandle(request, engine._cancel)
    state = RequestState(request, engine._make_sequences(request, None), handle, queued_at=time.monotonic())
    engine._live[request.request_id] = handle
    engine.core.add(state)
    handle.cancel()  # before any step drained the inbox
    assert engine.core.step() == []
    assert engine.core.steps_total == 0 and not engine.scheduler.has_work()
    assert engine.stats().used_blocks == 0 and not engine.core.requests


async def test_the_kv_gauge_follows_an_abort_at_once(llama):
    gauges = Gauges()
    engine = Engine(llama, Settings(max_batch_total_tokens=4096), observer=gauges)
    request = long_request()
    handle = RequestHandle(request, engine._cancel)
    state = RequestState(request, engine._make_sequences(request, None), handle, queued_at=time.monotonic())
    engine._live[request.request_id] = handle
    engine.core.add(state)
    engine.core.step()  # prefill: blocks held
    assert gauges.kv_used[-1] > 0
    handle.cancel()
    engine.core.step()  # nothing left to run: no batch, yet the gauge drops
    assert gauges.kv_used[-1] == 0


async def test_result_is_woken_once_at_the_end_not_at_every_step():
    """A non-streamed request's waiter sleeps through the steps (their events stay queued, unread)
    and wakes for the result; a failure or a cancel wakes it too."""
    request = long_request()
    handle = RequestHandle(request, lambda _request_id: None)
    waiter = asyncio.create_task(handle.result())
    for step in range(3):
        handle._deliver([object()], None, None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiter.done() and len(handle._events) == step + 1  # not woken to read them
    result = object()
    handle._deliver([object()], result, None)
    assert await asyncio.wait_for(waiter, 5) is result

    failing = RequestHandle(long_request(), lambda _request_id: None)
    waiter = asyncio.create_task(failing.result())
    await asyncio.sleep(0)
    failing._deliver([], None, UnhealthyError("gone"))
    with pytest.raises(UnhealthyError):
        await asyncio.wait_for(waiter, 5)

    cancelled = RequestHandle(long_request(), lambda _request_id: None)
    waiter = asyncio.create_task(cancelled.result())
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(Exception, match="cancelled"):
        await asyncio.wait_for(waiter, 5)
