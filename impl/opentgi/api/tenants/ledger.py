"""Per-tenant quotas and usage: what each tenant has in flight, used in the last minute, and in all.

    lease = ledger.admit(tenant)        # TenantQuotaError (429 + Retry-After) past a quota
    ...                                 # the generation runs
    lease.settle(requests, handles)     # once, however it ended: counts what it used

A request uses its prompt tokens (cached ones included, as usage reports them) plus the tokens
generated for it; a cancelled one counts what was generated before it was cancelled. Usage is
counted when a request ends, so requests already in flight may together pass `tokens_per_minute`;
the next one is refused until enough of the last 60 s has aged out (its Retry-After says when).
Every count also goes to the app's per-tenant Prometheus counters (opentgi.metrics).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from opentgi.api.errors import StatusError
from opentgi.api.tenants.table import Tenant, TenantFileError, TenantTable, load_tenant_file

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # tokens_per_minute is over any rolling minute
RETRY_CONCURRENCY_S = 1  # Retry-After when max_concurrent_requests is reached
REASONS = ("tokens_per_minute", "max_concurrent_requests")  # why a request is refused


class TenantQuotaError(StatusError):
    """A tenant's quota is used up: 429 with `Retry-After`, in the route's own error shape."""

    def __init__(self, tenant: str, reason: str, retry_after_s: int, message: str):
        super().__init__(429, message, {"Retry-After": str(retry_after_s)})
        self.tenant = tenant
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class TenantUsage:
    requests: int = 0  # admitted (past the quotas)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> requests refused
    in_flight: int = 0
    window: deque = field(default_factory=deque)  # (ended at, tokens) of the last WINDOW_S seconds
    window_tokens: int = 0

    def as_json(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "total_tokens": self.prompt_tokens + self.generated_tokens,
                "rejected": {reason: self.rejected.get(reason, 0) for reason in REASONS}, "in_flight": self.in_flight,
                "tokens_last_minute": self.window_tokens}


class TenantLedger:
    def __init__(self, table: TenantTable, metrics=None, clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.metrics = metrics  # opentgi.metrics.Metrics, or None
        self.clock = clock
        self._lock = threading.Lock()
        self.usage: dict[str, TenantUsage] = {t.name: TenantUsage() for t in table.tenants}

    def admit(self, tenant: Tenant) -> Lease:
        """A slot for one request of `tenant`, or TenantQuotaError."""
        with self._lock:
            usage = self.usage.setdefault(tenant.name, TenantUsage())
            now = self.clock()
            self._age(usage, now)
            refusal = None
            if tenant.max_concurrent_requests is not None and usage.in_flight >= tenant.max_concurrent_requests:
                refusal = TenantQuotaError(
                    tenant.name, "max_concurrent_requests", RETRY_CONCURRENCY_S,
                    f"tenant {tenant.name!r} has reached its max_concurrent_requests ({usage.in_flight} in flight)")
            elif tenant.tokens_per_minute is not None and usage.window_tokens >= tenant.tokens_per_minute:
                refusal = TenantQuotaError(
                    tenant.name, "tokens_per_minute", self._retry_after(usage, tenant.tokens_per_minute, now),
                    f"tenant {tenant.name!r} used {usage.window_tokens} tokens in the last minute, its limit "
                    f"is {tenant.tokens_per_minute} (tokens_per_minute)")
            if refusal is not None:
                usage.rejected[refusal.reason] = usage.rejected.get(refusal.reason, 0) + 1
            else:
                usage.in_flight += 1
                usage.requests += 1
        if self.metrics is not None:
            if refusal is not None:
                self.metrics.tenant_rejected(tenant.name, refusal.reason)
            else:
                self.metrics.tenant_request(tenant.name)
        if refusal is not None:
            raise refusal
        return Lease(self, tenant)

    def _settle(self, tenant: Tenant, prompt_tokens: int, generated_tokens: int, queue_s: list[float]) -> None:
        with self._lock:
            usage = self.usage[tenant.name]
            now = self.clock()
            usage.in_flight -= 1
            usage.prompt_tokens += prompt_tokens
            usage.generated_tokens += generated_tokens
            used = prompt_tokens + generated_tokens
            if used:
                usage.window.append((now, used))
                usage.window_tokens += used
            self._age(usage, now)
        if self.metrics is not None:
            self.metrics.tenant_tokens(tenant.name, prompt_tokens=prompt_tokens, generated_tokens=generated_tokens,
                                       queue_s=queue_s)

    def _age(self, usage: TenantUsage, now: float) -> None:
        while usage.window and usage.window[0][0] <= now - WINDOW_S:
            usage.window_tokens -= usage.window.popleft()[1]

    @staticmethod
    def _retry_after(usage: TenantUsage, limit: int, now: float) -> int:
        """Whole seconds until the tokens of the last minute fall below `limit`."""
        left = usage.window_tokens
        for ended_at, tokens in usage.window:
            left -= tokens
            if left < limit:
                return max(1, math.ceil(ended_at + WINDOW_S - now))
        return 1

    def snapshot(self) -> dict[str, dict]:
        """Per-tenant totals (GET /v1/usage) of the current tenants, in the file's order."""
        with self._lock:
            now = self.clock()
            out = {}
            for tenant in self.table.tenants:
                usage = self.usage.setdefault(tenant.name, TenantUsage())
                self._age(usage, now)
                out[tenant.name] = usage.as_json()
            return out

    def reload(self, path: str) -> bool:
        """Re-reads the tenants file (SIGHUP): new requests see the new keys, weights and quotas;
        requests in flight finish under their lease and count to their tenant's name, whose usage
        is kept. A file with a mistake is logged and the old tenants stay. True when reloaded."""
        try:
            table = load_tenant_file(path)
        except TenantFileError as exc:
            log.error("tenants not reloaded, the old ones stay: %s", exc)
            return False
        with self._lock:
            for tenant in table.tenants:
                self.usage.setdefault(tenant.name, TenantUsage())
            self.table.replace(table)
        log.info("tenants reloaded from %s: %s", path, ", ".join(t.name for t in table.tenants))
        return True


def reload_on_sighup(ledger: TenantLedger, path: str):
    """SIGHUP reloads `path` into `ledger` (in a thread of its own: a signal handler may interrupt
    the event loop while it holds the ledger's lock). Returns the handler it replaced."""

    def on_sighup(_signum, _frame):
        threading.Thread(target=ledger.reload, args=(path,), name="opentgi-tenants-reload", daemon=True).start()

    return signal.signal(signal.SIGHUP, on_sighup)


class Lease:
    """One admitted request's slot; `settle` (once, idempotent) frees it and counts its usage."""

    def __init__(self, ledger: TenantLedger, tenant: Tenant):
        self.ledger = ledger
        self.tenant = tenant
        self.settled = False

    def settle(self, requests: list, handles: list) -> None:
        """`requests`: the engine requests submitted (GenerationRequest); `handles`: their handles.
        A request whose handle never came (refused on submit) used nothing."""
        if self.settled:
            return
        self.settled = True
        prompt = generated = 0
        queue_s = []
        for request, handle in zip(requests, handles):
            prompt += request.num_prompt_tokens
            final = getattr(handle, "final", None)
            if final is not None:
                generated += final.generated_tokens
                timings = final.timings
                if timings.scheduled_at is not None:
                    queue_s.append(max(0.0, timings.scheduled_at - timings.queued_at))
            else:
                generated += getattr(handle, "num_generated_tokens", 0)
        self.ledger._settle(self.tenant, prompt, generated, queue_s)
