"""Prometheus metrics (opentgi/metrics.py): TGI's names, types, labels, buckets and text format."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from opentgi.engine.observer import EngineObserver
from opentgi.metrics import CONTENT_TYPE, Metrics, MetricsObserver, duration_buckets

torch.set_num_threads(1)

TGI_COUNTERS = ["tgi_request_count", "tgi_request_success", "tgi_request_failure", "tgi_batch_concat",
                "tgi_batch_inference_count", "tgi_batch_inference_success", "tgi_batch_inference_failure"]
TGI_GAUGES = ["tgi_queue_size", "tgi_batch_current_size", "tgi_batch_current_max_tokens"]
TGI_HISTOGRAMS = ["tgi_request_duration", "tgi_request_validation_duration", "tgi_request_queue_duration",
                  "tgi_request_inference_duration", "tgi_request_mean_time_per_token_duration",
                  "tgi_request_generated_tokens", "tgi_request_input_length", "tgi_request_max_new_tokens",
                  "tgi_batch_next_size", "tgi_batch_forward_duration", "tgi_batch_decode_duration",
                  "tgi_batch_filter_duration", "tgi_batch_inference_duration"]


def text(metrics: Metrics) -> str:
    body, content_type = metrics.render()
    assert content_type == CONTENT_TYPE
    return body.decode()


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the exposition, parsed by prometheus-client's own parser (which proves the
    format valid). The parser names every counter sample `<name>_total`; keys use the exposed name."""
    body = text(metrics)
    exposed = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and line[0] != "#"}
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            name = s.name if s.name in exposed else s.name.removesuffix("_total")
            assert name in exposed, s.name
            out[(name, tuple(sorted(s.labels.items())))] = s.value
    return out


def type_lines(metrics: Metrics) -> dict[str, str]:
    return {line.split()[2]: line.split()[3] for line in text(metrics).splitlines() if line.startswith("# TYPE")}


def test_tgi_families_with_their_types_and_no_total_suffix():
    fresh = type_lines(Metrics())
    assert "tgi_request_failure" not in fresh and "tgi_batch_concat" not in fresh  # labelled, unused yet
    m = Metrics()
    m.request_finished(ok=False, err="validation")
    m.observer.on_batch_concat(reason="wait_exceeded")
    m.observer.on_batch(method="decode", size=1, max_tokens=1, duration_s=0.1, ok=True, decode_s=0.01,
                        filter_s=0.01)
    types = type_lines(m)
    for name in TGI_COUNTERS:
        assert types[name] == "counter"
    for name in TGI_GAUGES:
        assert types[name] == "gauge"
    for name in TGI_HISTOGRAMS:
        assert types[name] == "histogram"
    body = text(Metrics())
    assert "tgi_request_count 0\n" in body
    assert not any(n.startswith("tgi_") and n.endswith("_total") for n in types)
    assert all(n.startswith(("tgi_", "opentgi_")) for n in types)
    assert "\n\n# TYPE tgi_request_success counter\n" in body  # one blank line between families


def test_duration_buckets_are_tgis():
    b = duration_buckets()
    assert len(b) == 35
    assert b[0] == pytest.approx(0.00015) and b[-1] == pytest.approx(0.0001 * 1.5**35)
    s = samples(Metrics())
    les = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "tgi_request_duration_bucket")
    assert les[:-1] == pytest.approx(b) and les[-1] == float("inf")


def test_token_histogram_buckets_follow_the_limits():
    s = samples(Metrics(max_input_tokens=200, max_total_tokens=1000))

    def bounds(name):
        return sorted(float(dict(k[1])["le"]) for k in s if k[0] == f"{name}_bucket")

    assert bounds("tgi_request_input_length")[:3] == [2.0, 4.0, 6.0]
    assert bounds("tgi_request_input_length")[-2] == 200.0
    assert bounds("tgi_request_generated_tokens")[:2] == [10.0, 20.0]
    assert bounds("tgi_request_max_new_tokens")[-2] == 1000.0
    assert bounds("tgi_batch_next_size")[:3] == [1.0, 2.0, 3.0] and bounds("tgi_batch_next_size")[-2] == 1024.0


def test_successful_request_records_tgis_request_histograms():
    m = Metrics(max_input_tokens=100, max_total_tokens=200)
    m.request_started()
    m.request_finished(ok=True, total_s=1.5, validation_s=0.001, queue_s=0.2, inference_s=1.0,
                       generated_tokens=20, input_length=7, max_new_tokens=20)
    s = samples(m)
    assert s[("tgi_request_count", ())] == 1
    assert s[("tgi_request_success", ())] == 1
    assert s[("tgi_request_duration_count", ())] == 1 and s[("tgi_request_duration_sum", ())] == 1.5
    assert s[("tgi_request_queue_duration_sum", ())] == 0.2
    assert s[("tgi_request_validation_duration_count", ())] == 1
    assert s[("tgi_request_mean_time_per_token_duration_sum", ())] == pytest.approx(0.05)
    assert s[("tgi_request_generated_tokens_sum", ())] == 20
    assert s[("tgi_request_input_length_sum", ())] == 7
    assert s[("tgi_request_max_new_tokens_sum", ())] == 20
    # `le` is inclusive: 7 tokens fall in the bucket le="7" (max_input 100 -> buckets 1, 2, ..., 100)
    assert s[("tgi_request_input_length_bucket", (("le", "7"),))] == 1
    assert s[("tgi_request_input_length_bucket", (("le", "6"),))] == 0
    assert s[("tgi_request_input_length_bucket", (("le", "+Inf"),))] == 1


def test_failed_request_counts_by_error_type_only():
    m = Metrics()
    for err in ("validation", "validation", "overloaded"):
        m.request_started()
        m.request_finished(ok=False, err=err)
    s = samples(m)
    assert s[("tgi_request_count", ())] == 3
    assert s[("tgi_request_failure", (("err", "validation"),))] == 2
    assert s[("tgi_request_failure", (("err", "overloaded"),))] == 1
    assert s[("tgi_request_success", ())] == 0
    assert s[("tgi_request_duration_count", ())] == 0
    assert s[("tgi_request_input_length_count", ())] == 0


def test_observer_batch_metrics():
    m = Metrics()
    obs = m.observer
    assert isinstance(obs, MetricsObserver) and isinstance(obs, EngineObserver)
    obs.on_queue_size(3)
    obs.on_batch(method="prefill", size=4, max_tokens=512, duration_s=0.05, ok=True, next_size=2)
    obs.on_batch(method="decode", size=4, max_tokens=520, duration_s=0.01, ok=True,
                 forward_s=0.008, decode_s=0.001, filter_s=0.0005)
    obs.on_batch(method="decode", size=4, max_tokens=520, duration_s=0.01, ok=False)
    obs.on_batch_concat(reason="backpressure")
    s = samples(m)
    assert s[("tgi_queue_size", ())] == 3
    assert s[("tgi_batch_current_size", ())] == 4 and s[("tgi_batch_current_max_tokens", ())] == 520
    assert s[("tgi_batch_inference_count", (("method", "prefill"),))] == 1
    assert s[("tgi_batch_inference_count", (("method", "decode"),))] == 2
    assert s[("tgi_batch_inference_success", (("method", "decode"),))] == 1
    assert s[("tgi_batch_inference_failure", (("method", "decode"),))] == 1
    assert s[("tgi_batch_inference_failure", (("method", "prefill"),))] == 0
    assert s[("tgi_batch_forward_duration_sum", (("method", "prefill"),))] == 0.05
    assert s[("tgi_batch_forward_duration_sum", (("method", "decode"),))] == 0.008
    assert s[("tgi_batch_decode_duration_count", (("method", "decode"),))] == 1
    assert s[("tgi_batch_filter_duration_sum", (("method", "decode"),))] == 0.0005
    assert s[("tgi_batch_inference_duration_count", (("method", "decode"),))] == 1
    assert s[("tgi_batch_next_size_sum", ())] == 2 and s[("tgi_batch_next_size_count", ())] == 1
    assert s[("tgi_batch_concat", (("reason", "backpressure"),))] == 1


def test_observer_opentgi_metrics():
    m = Metrics()
    obs = m.observer
    obs.on_kv_blocks(used=10, free=90, cached=5)
    obs.on_prefix_cache(hit_tokens=30, query_tokens=120)
    obs.on_prefix_cache(hit_tokens=60, query_tokens=150)  # totals, not increments
    obs.on_preemption(2)
    obs.on_preemption(1)
    obs.on_request_finished(request_id="r", ok=True, input_tokens=7, generated_tokens=5, queue_s=0.1,
                            inference_s=0.2)
    s = samples(m)
    assert s[("opentgi_kv_blocks_used", ())] == 10 and s[("opentgi_kv_blocks_free", ())] == 90
    assert s[("opentgi_kv_blocks_cached", ())] == 5
    assert s[("opentgi_prefix_cache_hit_tokens_total", ())] == 60
    assert s[("opentgi_prefix_cache_query_tokens_total", ())] == 150
    assert s[("opentgi_prefix_cache_hit_rate", ())] == pytest.approx(0.4)
    assert s[("opentgi_preemptions_total", ())] == 3
    assert s[("opentgi_prompt_tokens_total", ())] == 7 and s[("opentgi_generation_tokens_total", ())] == 5
    assert s[("tgi_request_count", ())] == 0  # the engine's view never double-counts requests


def test_instances_are_independent():
    a, b = Metrics(), Metrics()
    a.request_started()
    assert samples(a)[("tgi_request_count", ())] == 1
    assert samples(b)[("tgi_request_count", ())] == 0


def test_concurrent_updates_are_not_lost():
    m = Metrics()

    def work():
        for _ in range(2000):
            m.request_started()
            m.observer.on_batch(method="decode", size=1, max_tokens=1, duration_s=0.001, ok=True)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = samples(m)
    assert s[("tgi_request_count", ())] == 8000
    assert s[("tgi_batch_inference_duration_count", (("method", "decode"),))] == 8000


def test_label_values_are_escaped():
    m = Metrics()
    m.request_finished(ok=False, err='we"ird\\err\nx')
    assert samples(m)[("tgi_request_failure", (("err", 'we"ird\\err\nx'),))] == 1


def test_set_limits_rebuilds_the_token_buckets():
    m = Metrics()
    m.request_validated(input_length=3, max_new_tokens=9)
    m.set_limits(max_input_tokens=50, max_total_tokens=300)
    s = samples(m)
    les = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "tgi_request_input_length_bucket")
    assert les[0] == 0.5 and les[-2] == 50.0
    assert s[("tgi_request_input_length_count", ())] == 0  # reset: call it before serving
    assert s[("tgi_request_max_new_tokens_bucket", (("le", "3"),))] == 0


def test_module_functions_record_into_the_installed_instance():
    import opentgi.metrics as metrics_module

    previous = metrics_module._installed
    try:
        m = metrics_module.install(Metrics(max_input_tokens=10, max_total_tokens=20))
        assert metrics_module.installed() is m
        metrics_module.record_request()
        metrics_module.observe_input_length(4)
        metrics_module.observe_max_new_tokens(8)
        metrics_module.record_success(generated_tokens=8, total_s=0.5, validation_s=0.01, queue_s=0.1,
                                      inference_s=0.4)
        metrics_module.record_request()
        metrics_module.record_failure("overloaded")
        body, content_type = metrics_module.render()
        assert (body, content_type) == m.render()
        s = samples(m)
        assert s[("tgi_request_count", ())] == 2 and s[("tgi_request_success", ())] == 1
        assert s[("tgi_request_failure", (("err", "overloaded"),))] == 1
        assert s[("tgi_request_input_length_sum", ())] == 4 and s[("tgi_request_max_new_tokens_sum", ())] == 8
        assert s[("tgi_request_mean_time_per_token_duration_sum", ())] == pytest.approx(0.05)
    finally:
        metrics_module._installed = previous


async def test_real_engine_reports_through_the_observer(tiny_llama):
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine
    from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams

    m = Metrics()
    engine = Engine.from_settings(Settings(model_id=str(tiny_llama), device="cpu", max_batch_total_tokens=2048),
                                  observer=m.observer)
    await engine.start()
    try:
        handles = [await engine.submit(GenerationRequest([1, 504, 3458 + i, 314], SamplingParams(),
                                                         StoppingParams(max_new_tokens=5, ignore_eos=True)))
                   for i in range(3)]
        results = [await h.result() for h in handles]
    finally:
        await engine.stop()
    s = samples(m)
    steps = s[("tgi_batch_inference_count", (("method", "prefill"),))] + \
        s[("tgi_batch_inference_count", (("method", "decode"),))]
    assert s[("tgi_batch_inference_count", (("method", "prefill"),))] >= 1
    assert s[("tgi_batch_inference_count", (("method", "decode"),))] >= 4  # 5 tokens: 1 from prefill
    assert steps == engine.stats().steps_total
    assert s[("tgi_batch_inference_success", (("method", "decode"),))] == \
        s[("tgi_batch_inference_count", (("method", "decode"),))]
    assert s[("tgi_batch_inference_duration_count", (("method", "decode"),))] >= 4
    assert s[("tgi_queue_size", ())] == 0
    assert 0 < s[("opentgi_kv_blocks_free", ())] <= engine.stats().num_blocks
    assert s[("opentgi_prompt_tokens_total", ())] == 12
    assert s[("opentgi_generation_tokens_total", ())] == sum(r.sequences[0].generated_tokens for r in results) == 15
