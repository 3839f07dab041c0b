"""Every Prometheus metric of the server, with TGI 2.1.2's names, types, labels and buckets, so TGI's
Grafana dashboards work unchanged; opentgi's own metrics carry an `opentgi_` prefix.

Interface (one `Metrics` per app; tests make their own instances and stay independent):

    metrics = Metrics(max_input_tokens=..., max_total_tokens=...)   # bucket bounds, as TGI's router
    Engine.from_settings(settings, observer=metrics.observer)        # engine-side metrics
    metrics.request_started() / request_validated(...) / request_finished(ok=..., ...)
    body, content_type = metrics.render()                            # GET /metrics

The API handlers reach the serving app's instance through module-level functions that forward to
the installed one (`install(metrics)`, which the app factory calls; `record_request`,
`record_success`, `record_failure`, `render`, ...).

TGI's router exposes counters without the `_total` suffix that prometheus-client would add, so the
exposition is written here in TGI's text format. Histogram buckets, as TGI's router sets them: every
`*_duration` histogram 0.0001 * 1.5^k for k = 1..35; `tgi_request_input_length` max_input_tokens/100
* (1..100); `tgi_request_generated_tokens` and `tgi_request_max_new_tokens` max_total_tokens/100 *
(1..100); `tgi_batch_next_size` 1..1024; `tgi_request_skipped_tokens` (`--speculate N`: per step of a
sequence, the drafts it kept) 0..N.

The `tgi_request_*` metrics come from the API handlers (input length and max_new_tokens once
validation passed, as TGI records them), the `tgi_batch_*` and `tgi_queue_size` ones from the engine
loop through `MetricsObserver`. An update takes one lock and a few dict operations (engine-safe).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence

from opentgi.engine.observer import EngineObserver

CONTENT_TYPE = "text/plain; charset=utf-8"  # what TGI's /metrics answers


def duration_buckets() -> list[float]:
    """TGI: value = 0.0001; 35 times value *= 1.5 (the same float steps, so the same `le` text)."""
    out, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        out.append(value)
    return out


def linear_buckets(maximum: int, n: int = 100) -> list[float]:
    return [(maximum / float(n)) * (x + 1) for x in range(n)]


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Family:
    """One metric family: its children by label values. Callers hold the registry lock."""

    def __init__(self, name: str, kind: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = ()):
        self.name, self.kind, self.labelnames = name, kind, tuple(labelnames)
        self.buckets = list(buckets)
        self.children: dict[tuple[str, ...], list[float]] = {}
        if not self.labelnames:
            self._child(())

    def _child(self, labels: tuple[str, ...]) -> list[float]:
        child = self.children.get(labels)
        if child is None:
            # counter/gauge: [value]; histogram: [count per bucket..., count above the last, sum, count]
            child = self.children[labels] = [0.0] * (len(self.buckets) + 3 if self.kind == "histogram" else 1)
        return child

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self._child(labels)[0] += amount

    def set(self, value: float, labels: tuple[str, ...] = ()) -> None:
        self._child(labels)[0] = value

    def observe(self, value: float, labels: tuple[str, ...] = ()) -> None:
        child = self._child(labels)
        child[bisect.bisect_left(self.buckets, value)] += 1  # `le` is inclusive
        child[-2] += value
        child[-1] += 1

    def render(self, out: list[str]) -> None:
        if not self.children:  # a labelled family nothing has used yet
            return
        out.append(f"# TYPE {self.name} {self.kind}\n")
        for labels, child in sorted(self.children.items()):
            if self.kind != "histogram":
                out.append(f"{self.name}{_labels_text(self.labelnames, labels)} {_fmt(child[0])}\n")
                continue
            cumulative = 0.0
            for bound, count in zip([*self.buckets, math.inf], child):
                cumulative += count
                le = _labels_text(self.labelnames, labels, f'le="{_fmt(bound)}"')
                out.append(f"{self.name}_bucket{le} {_fmt(cumulative)}\n")
            plain = _labels_text(self.labelnames, labels)
            out.append(f"{self.name}_sum{plain} {_fmt(child[-2])}\n")
            out.append(f"{self.name}_count{plain} {_fmt(child[-1])}\n")
        out.append("\n")


METHODS = ("prefill", "decode")


class Metrics:
    """All of the server's metrics, one instance per app. Thread-safe."""

    def __init__(self, *, max_input_tokens: int = 4095, max_total_tokens: int = 4096):
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        dur = duration_buckets()
        c, g, h = self._counter, self._gauge, self._histogram
        # --- requests (API handlers) ---
        self.request_count = c("tgi_request_count")
        self.request_success = c("tgi_request_success")
        self.request_failure = c("tgi_request_failure", ("err",))
        self.request_duration = h("tgi_request_duration", dur)
        self.request_validation_duration = h("tgi_request_validation_duration", dur)
        self.request_queue_duration = h("tgi_request_queue_duration", dur)
        self.request_inference_duration = h("tgi_request_inference_duration", dur)
        self.request_mean_time_per_token = h("tgi_request_mean_time_per_token_duration", dur)
        self.request_generated_tokens = h("tgi_request_generated_tokens", ())
        self.request_input_length = h("tgi_request_input_length", ())
        self.request_max_new_tokens = h("tgi_request_max_new_tokens", ())
        self.set_limits(max_input_tokens, max_total_tokens)
        # --- batches and queue (engine loop) ---
        self.queue_size = g("tgi_queue_size")
        self.batch_current_size = g("tgi_batch_current_size")
        self.batch_current_max_tokens = g("tgi_batch_current_max_tokens")
        self.batch_concat = c("tgi_batch_concat", ("reason",))
        self.batch_inference_count = c("tgi_batch_inference_count", ("method",))
        self.batch_inference_success = c("tgi_batch_inference_success", ("method",))
        self.batch_inference_failure = c("tgi_batch_inference_failure", ("method",))
        self.batch_next_size = h("tgi_batch_next_size", [float(x + 1) for x in range(1024)])
        self.batch_forward_duration = h("tgi_batch_forward_duration", dur, ("method",))
        self.batch_decode_duration = h("tgi_batch_decode_duration", dur, ("method",))
        self.batch_filter_duration = h("tgi_batch_filter_duration", dur, ("method",))
        self.batch_inference_duration = h("tgi_batch_inference_duration", dur, ("method",))
        for method in METHODS:  # TGI shows these once used; present from the start here
            for family in (self.batch_inference_count, self.batch_inference_success, self.batch_inference_failure):
                family._child((method,))
        # --- opentgi's own ---
        self.kv_blocks_used = g("opentgi_kv_blocks_used")
        self.kv_blocks_free = g("opentgi_kv_blocks_free")
        self.kv_blocks_cached = g("opentgi_kv_blocks_cached")
        self.prefix_cache_hit_tokens = c("opentgi_prefix_cache_hit_tokens_total")
        self.prefix_cache_query_tokens = c("opentgi_prefix_cache_query_tokens_total")
        self.prefix_cache_hit_rate = g("opentgi_prefix_cache_hit_rate")
        self.preemptions = c("opentgi_preemptions_total")
        self.prompt_tokens = c("opentgi_prompt_tokens_total")
        self.generation_tokens = c("opentgi_generation_tokens_total")
        # requests queued per LoRA adapter (label: the adapter's name, or the base model's id)
        self.adapter_requests = c("opentgi_adapter_requests_total", ("adapter",))
        # per tenant (--tenants, or the one tenant of --api-key; label: the tenant's name, never a key)
        self.tenant_requests = c("opentgi_tenant_requests_total", ("tenant",))
        self.tenant_prompt_tokens = c("opentgi_tenant_prompt_tokens_total", ("tenant",))
        self.tenant_generated_tokens = c("opentgi_tenant_generated_tokens_total", ("tenant",))
        self.tenant_rejections = c("opentgi_tenant_rejections_total", ("tenant", "reason"))
        self.tenant_queue_duration = h("opentgi_tenant_queue_duration", dur, ("tenant",))
        # --- speculative decoding (--speculate) ---
        self.request_skipped_tokens = h("tgi_request_skipped_tokens", [0.0])
        self.spec_draft_tokens = c("opentgi_spec_draft_tokens_total")
        self.spec_accepted_tokens = c("opentgi_spec_accepted_tokens_total")
        self.spec_acceptance_rate = g("opentgi_spec_acceptance_rate")
        self.request_skipped_tokens.children.clear()  # shown once speculation runs
        self.observer = MetricsObserver(self)

    # --- definitions ---------------------------------------------------------------------------
    def _add(self, family: _Family) -> _Family:
        assert family.name not in self._families, family.name
        self._families[family.name] = family
        return family

    def _counter(self, name: str, labelnames: Sequence[str] = ()) -> _Family:
        return self._add(_Family(name, "counter", labelnames))

    def _gauge(self, name: str) -> _Family:
        return self._add(_Family(name, "gauge"))

    def _histogram(self, name: str, buckets: Iterable[float], labelnames: Sequence[str] = ()) -> _Family:
        return self._add(_Family(name, "histogram", labelnames, list(buckets)))

    def set_limits(self, max_input_tokens: int, max_total_tokens: int) -> None:
        """Bucket bounds of the token-count histograms (TGI: limit/100 * 1..100); resets them, so call
        it before serving."""
        with self._lock:
            for family, limit in ((self.request_input_length, max_input_tokens),
                                  (self.request_generated_tokens, max_total_tokens),
                                  (self.request_max_new_tokens, max_total_tokens)):
                family.buckets = linear_buckets(limit)
                family.children.clear()
                family._child(())

    def set_speculate(self, num_speculative_tokens: int) -> None:
        """Buckets of tgi_request_skipped_tokens, 0..N as TGI's router sets them."""
        with self._lock:
            self.request_skipped_tokens.buckets = [float(x) for x in range(num_speculative_tokens + 1)]
            self.request_skipped_tokens.children.clear()

    # --- request level (API handlers) ----------------------------------------------------------
    def request_started(self) -> None:
        """A generation request arrived (before validation): tgi_request_count."""
        with self._lock:
            self.request_count.inc()

    def request_validated(self, *, input_length: int | None = None, max_new_tokens: int | None = None) -> None:
        """Validation passed (TGI records these two there, whatever happens next)."""
        with self._lock:
            if input_length is not None:
                self.request_input_length.observe(input_length)
            if max_new_tokens is not None:
                self.request_max_new_tokens.observe(max_new_tokens)

    def request_submitted(self, adapter: str) -> None:
        """A request reached the engine's queue, served by `adapter` (the base model's id for none)."""
        with self._lock:
            self.adapter_requests.inc((adapter,))

    def tenant_request(self, tenant: str) -> None:
        """A tenant's request passed its quotas."""
        with self._lock:
            self.tenant_requests.inc((tenant,))

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        """A tenant's request was refused (429): reason "tokens_per_minute" | "max_concurrent_requests"."""
        with self._lock:
            self.tenant_rejections.inc((tenant, reason))

    def tenant_tokens(self, tenant: str, *, prompt_tokens: int, generated_tokens: int,
                      queue_s: Iterable[float] = ()) -> None:
        """A tenant's request ended (done or cancelled): what it used, and its engine requests' queue times."""
        with self._lock:
            self.tenant_prompt_tokens.inc((tenant,), prompt_tokens)
            self.tenant_generated_tokens.inc((tenant,), generated_tokens)
            for seconds in queue_s:
                self.tenant_queue_duration.observe(seconds, (tenant,))

    def request_finished(self, ok: bool, err: str | None = None, *, total_s: float | None = None,
                         validation_s: float | None = None, queue_s: float | None = None,
                         inference_s: float | None = None, generated_tokens: int | None = None,
                         input_length: int | None = None, max_new_tokens: int | None = None) -> None:
        """The request ended. ok=False: `err` is TGI's error_type ("validation", "overloaded",
        "generation", "incomplete_generation", ...) and only tgi_request_failure{err} counts.
        ok=True: the durations (seconds) and token counts that are given go to their histograms, as
        TGI records them. input_length / max_new_tokens, when given, are recorded as by
        request_validated (pass them here or there, not both)."""
        self.request_validated(input_length=input_length, max_new_tokens=max_new_tokens)
        with self._lock:
            if not ok:
                self.request_failure.inc((err or "unknown",))
                return
            for family, value in ((self.request_duration, total_s),
                                  (self.request_validation_duration, validation_s),
                                  (self.request_queue_duration, queue_s),
                                  (self.request_inference_duration, inference_s),
                                  (self.request_generated_tokens, generated_tokens)):
                if value is not None:
                    family.observe(value)
            if inference_s is not None and generated_tokens:
                self.request_mean_time_per_token.observe(inference_s / generated_tokens)
            self.request_success.inc()

    # --- exposition ----------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        out: list[str] = []
        with self._lock:
            for family in self._families.values():
                family.render(out)
        return "".join(out).encode(), CONTENT_TYPE


class MetricsObserver(EngineObserver):
    """The engine's hooks (engine/observer.py) mapped to TGI's batch metrics and opentgi's own."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def on_queue_size(self, waiting: int) -> None:
        with self.m._lock:
            self.m.queue_size.set(waiting)

    def on_batch(self, *, method: str, size: int, max_tokens: int, duration_s: float, ok: bool,
                 forward_s: float | None = None, decode_s: float | None = None, filter_s: float | None = None,
                 next_size: int | None = None) -> None:
        m, labels = self.m, (method,)
        with m._lock:
            m.batch_inference_count.inc(labels)
            m.batch_current_size.set(size)
            m.batch_current_max_tokens.set(max_tokens)
            if next_size is None and method == "prefill":
                next_size = size  # the engine did not say how many came from the queue: the step's rows
            if next_size:
                m.batch_next_size.observe(next_size)
            if not ok:
                m.batch_inference_failure.inc(labels)
                return
            m.batch_forward_duration.observe(duration_s if forward_s is None else forward_s, labels)
            if decode_s is not None:
                m.batch_decode_duration.observe(decode_s, labels)
            if filter_s is not None:
                m.batch_filter_duration.observe(filter_s, labels)
            m.batch_inference_duration.observe(duration_s, labels)
            m.batch_inference_success.inc(labels)

    def on_idle(self) -> None:
        with self.m._lock:  # as TGI once its batch is empty
            self.m.batch_current_size.set(0)
            self.m.batch_current_max_tokens.set(0)

    def on_batch_concat(self, *, reason: str) -> None:
        with self.m._lock:
            self.m.batch_concat.inc((reason,))

    def on_request_finished(self, *, request_id: str, ok: bool, input_tokens: int, generated_tokens: int,
                            queue_s: float, inference_s: float) -> None:
        # The tgi_request_* histograms come from the API handlers (they also know validation and
        # total time); the engine's view feeds the token throughput counters.
        with self.m._lock:
            self.m.prompt_tokens.inc(amount=input_tokens)
            self.m.generation_tokens.inc(amount=generated_tokens)

    def on_speculation(self, *, draft_tokens: list[int], accepted_tokens: list[int]) -> None:
        m = self.m
        with m._lock:
            for kept in accepted_tokens:
                m.request_skipped_tokens.observe(kept)
            m.spec_draft_tokens.inc(amount=sum(draft_tokens))
            m.spec_accepted_tokens.inc(amount=sum(accepted_tokens))
            drafted = m.spec_draft_tokens.children[()][0]
            if drafted:
                m.spec_acceptance_rate.set(m.spec_accepted_tokens.children[()][0] / drafted)

    def on_preemption(self, num_sequences: int) -> None:
        with self.m._lock:
            self.m.preemptions.inc(amount=num_sequences)

    def on_kv_blocks(self, *, used: int, free: int, cached: int) -> None:
        with self.m._lock:
            self.m.kv_blocks_used.set(used)
            self.m.kv_blocks_free.set(free)
            self.m.kv_blocks_cached.set(cached)

    def on_prefix_cache(self, *, hit_tokens: int, query_tokens: int) -> None:
        with self.m._lock:  # cumulative totals: the counters follow them
            self.m.prefix_cache_hit_tokens.set(hit_tokens)
            self.m.prefix_cache_query_tokens.set(query_tokens)
            self.m.prefix_cache_hit_rate.set(hit_tokens / query_tokens if query_tokens else 0.0)


# --- the serving app's instance, for the API handlers ------------------------------------------------
_installed: Metrics | None = None
_install_lock = threading.Lock()


def install(metrics: Metrics) -> Metrics:
    """Make `metrics` the instance the module-level functions below record into (the app factory
    calls this with the app's instance)."""
    global _installed
    with _install_lock:
        _installed = metrics
    return metrics


def installed() -> Metrics:
    """The installed instance; a default one (TGI's default limits) when none was installed."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = Metrics()
        return _installed


def record_request() -> None:
    installed().request_started()


def observe_input_length(value: int) -> None:
    installed().request_validated(input_length=value)


def observe_max_new_tokens(value: int) -> None:
    installed().request_validated(max_new_tokens=value)


def record_success(*, generated_tokens: int, total_s: float | None = None, validation_s: float | None = None,
                   queue_s: float | None = None, inference_s: float | None = None) -> None:
    installed().request_finished(ok=True, total_s=total_s, validation_s=validation_s, queue_s=queue_s,
                                 inference_s=inference_s, generated_tokens=generated_tokens)


def record_failure(error_type: str) -> None:
    installed().request_finished(ok=False, err=error_type)


def render() -> tuple[bytes, str]:
    return installed().render()
