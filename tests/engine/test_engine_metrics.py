"""The engine's observer calls, read back through TGI's metrics (MetricsObserver) on a real tiny
engine: prefix-cache totals, tgi_batch_concat reasons, the forward/decode/filter split and the next
batch size of each step, the batch gauges at work and back at 0 once the engine is idle."""

from __future__ import annotations

import contextlib

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from opentgi.config import Settings
from opentgi.engine.engine import Engine
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.metrics import Metrics, MetricsObserver

torch.set_num_threads(1)

LONG_PROMPT = [1] + [504 + (i * 37) % 4000 for i in range(70)]


class RecordingMetricsObserver(MetricsObserver):
    """TGI's metrics, plus the on_batch calls kept for the assertions a gauge's last value hides."""

    def __init__(self, metrics: Metrics):
        super().__init__(metrics)
        self.batches: list[dict] = []

    def on_batch(self, **kw) -> None:
        self.batches.append(kw)
        super().on_batch(**kw)


@contextlib.asynccontextmanager
async def running(loaded, **settings):
    settings.setdefault("max_batch_total_tokens", 4096)
    metrics = Metrics()
    observer = RecordingMetricsObserver(metrics)
    engine = Engine(loaded, Settings(**settings), observer=observer)
    await engine.start()
    try:
        yield engine, metrics, observer
    finally:
        await engine.stop()


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    body = metrics.render()[0].decode()
    exposed = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and line[0] != "#"}
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            name = s.name if s.name in exposed else s.name.removesuffix("_total")
            out[(name, tuple(sorted(s.labels.items())))] = s.value
    return out


def request(ids, max_new: int) -> GenerationRequest:
    return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=max_new, ignore_eos=True))


async def join_running(engine, first_new: int = 200, second_new: int = 4):
    """A second request arrives while the first one decodes; returns both results."""
    first = await engine.submit(request([1, 504, 3458, 314], first_new))
    await anext(aiter(first))  # the first runs
    second = await engine.submit(request([1, 504, 3459, 315], second_new))
    return await first.result(), await second.result()


async def test_prefix_cache_counters_are_the_engines_running_totals(llama):
    async with running(llama, chunked_prefill_tokens=16) as (engine, metrics, _):
        for _ in range(3):
            await (await engine.submit(request(LONG_PROMPT, 2))).result()
        stats = engine.stats()
    s = samples(metrics)
    assert stats.prefix_hit_tokens >= 2 * 64  # the second and third runs reuse four full blocks
    assert s[("opentgi_prefix_cache_hit_tokens_total", ())] == stats.prefix_hit_tokens
    assert s[("opentgi_prefix_cache_query_tokens_total", ())] == stats.prefix_query_tokens
    assert s[("opentgi_prefix_cache_hit_rate", ())] == pytest.approx(
        stats.prefix_hit_tokens / stats.prefix_query_tokens)


async def test_concat_backpressure_when_enough_are_waiting(llama):
    # chunking off, TGI v2's rule: 1 waiting >= int(1 running x 1.0) joins before max_waiting_tokens
    async with running(llama, chunked_prefill_tokens=None, waiting_served_ratio=1.0,
                       max_waiting_tokens=10_000) as (engine, metrics, observer):
        await join_running(engine)
    s = samples(metrics)
    assert s[("tgi_batch_concat", (("reason", "backpressure"),))] == 1
    assert ("tgi_batch_concat", (("reason", "wait_exceeded"),)) not in s
    # each request was taken from the queue once, in its own prefill step
    assert s[("tgi_batch_next_size_count", ())] == 2 and s[("tgi_batch_next_size_sum", ())] == 2
    joined = [b for b in observer.batches if b["next_size"] == 1][1]
    assert joined["method"] == "prefill" and joined["size"] == 2  # the decode and the new prompt


async def test_concat_wait_exceeded_after_max_waiting_tokens(llama):
    # too few waiting for the ratio: the newcomer joins once max_waiting_tokens steps went by
    async with running(llama, chunked_prefill_tokens=None, waiting_served_ratio=100.0,
                       max_waiting_tokens=3) as (engine, metrics, _):
        await join_running(engine)
    s = samples(metrics)
    assert s[("tgi_batch_concat", (("reason", "wait_exceeded"),))] == 1
    assert ("tgi_batch_concat", (("reason", "backpressure"),)) not in s


async def test_concat_with_chunked_prefill_is_wait_exceeded(llama):
    async with running(llama, chunked_prefill_tokens=16) as (engine, metrics, _):
        await join_running(engine)
        # a long prompt alone (no concat): several prefill chunks, one request from the queue
        await (await engine.submit(request(LONG_PROMPT, 2))).result()
    s = samples(metrics)
    assert s[("tgi_batch_concat", (("reason", "wait_exceeded"),))] == 1
    assert s[("tgi_batch_inference_count", (("method", "prefill"),))] >= 2 + 5  # 71 tokens: 5 chunks
    assert s[("tgi_batch_next_size_count", ())] == 3 and s[("tgi_batch_next_size_sum", ())] == 3


async def test_step_timings_split_forward_decode_filter(llama):
    async with running(llama) as (engine, metrics, observer):
        handles = [await engine.submit(request([1, 504, 3458 + i, 314], 6)) for i in range(3)]
        for h in handles:
            await h.result()
    s = samples(metrics)
    for method in ("prefill", "decode"):
        steps = s[("tgi_batch_inference_count", (("method", method),))]
        assert steps >= 1
        for part in ("forward", "decode", "filter", "inference"):
            assert s[(f"tgi_batch_{part}_duration_count", (("method", method),))] == steps
        parts = sum(s[(f"tgi_batch_{part}_duration_sum", (("method", method),))]
                    for part in ("forward", "decode", "filter"))
        assert 0 < parts <= s[("tgi_batch_inference_duration_sum", (("method", method),))]
        assert s[("tgi_batch_forward_duration_sum", (("method", method),))] < \
            s[("tgi_batch_inference_duration_sum", (("method", method),))]
    for b in observer.batches:
        assert b["forward_s"] + b["decode_s"] + b["filter_s"] <= b["duration_s"]


async def test_batch_gauges_while_running_and_zero_when_idle(llama):
    async with running(llama) as (engine, metrics, observer):
        first, second = await join_running(engine, first_new=40, second_new=10)
        s = samples(metrics)
        assert s[("tgi_batch_current_size", ())] == 0
        assert s[("tgi_batch_current_max_tokens", ())] == 0
        # while running, max_tokens is what the batch may hold: prompt + max_new_tokens per request
        sizes = {b["size"] for b in observer.batches}
        assert sizes == {1, 2}
        for b in observer.batches:
            if b["size"] == 2:
                assert b["max_tokens"] == (4 + 40) + (4 + 10)
        assert observer.batches[0]["max_tokens"] == 4 + 40
        # the next request makes the gauges live again
        handle = await engine.submit(request([1, 504, 3460, 316], 30))
        await anext(aiter(handle))
        s = samples(metrics)
        assert s[("tgi_batch_current_size", ())] == 1
        assert s[("tgi_batch_current_max_tokens", ())] == 4 + 30
        await handle.result()
        assert samples(metrics)[("tgi_batch_current_size", ())] == 0
