"""Weighted fair sharing of the batch between tenants (`--tenants`), kept by the scheduler.

Every token the model computes for a sequence (a prompt chunk, a recompute, a decode) is service
for the sequence's tenant (`GenerationRequest.tenant`). A tenant's *share* is its service over the
last `window_s` seconds divided by its weight (`GenerationRequest.tenant_weight`). The scheduler asks
two questions of it:

- `next_tenant(tenants)`: of the tenants with a sequence waiting, the one furthest below its share
  (least weighted service) is admitted next; ties go to the one that comes first in queue order;
- `most_over_share(tenants)`: of the tenants with a sequence that could be preempted, the one with
  the most weighted service gives up its newest sequence first.

Requests without a tenant form one tenant of their own (`None`, weight 1). With a single tenant in
play both answers are that tenant, so the scheduler's order is exactly first-come, as without
tenants. Service is kept in one-second buckets (at most `window_s` of them per tenant), so a query
costs one pass over the tenants asked about.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

DEFAULT_WINDOW_S = 60.0


class FairShare:
    """Per-tenant service over a sliding window. Used on the engine thread only."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._buckets: dict[str | None, deque[list[float]]] = {}  # tenant -> [[second, tokens], ...]
        self._served: dict[str | None, float] = {}  # tenant -> tokens in its buckets
        self._weights: dict[str | None, float] = {}

    # --- recording ---------------------------------------------------------------------------
    def serve(self, tenant: str | None, weight: float, num_tokens: int) -> None:
        """`num_tokens` computed for `tenant` now (its weight as the request gave it)."""
        self._weights[tenant] = weight if weight > 0 else 1.0
        second = float(int(self.clock()))
        buckets = self._buckets.setdefault(tenant, deque())
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += num_tokens
        else:
            buckets.append([second, float(num_tokens)])
        self._served[tenant] = self._served.get(tenant, 0.0) + num_tokens

    # --- queries -----------------------------------------------------------------------------
    def served(self, tenant: str | None) -> float:
        """Tokens served to `tenant` within the window."""
        buckets = self._buckets.get(tenant)
        if not buckets:
            return 0.0
        horizon = self.clock() - self.window_s
        while buckets and buckets[0][0] + 1.0 <= horizon:  # the whole second lies before the window
            self._served[tenant] -= buckets.popleft()[1]
        if not buckets:
            self._served[tenant] = 0.0
        return self._served[tenant]

    def share(self, tenant: str | None, weight: float | None = None) -> float:
        """Weighted service: tokens served in the window / weight."""
        w = weight if weight is not None and weight > 0 else self._weights.get(tenant, 1.0)
        return self.served(tenant) / w

    def next_tenant(self, tenants: Iterable[tuple[str | None, float]]) -> str | None:
        """Of (tenant, weight) pairs in queue order, the tenant with the least weighted service
        (the first of equals)."""
        best, best_share = None, None
        for tenant, weight in tenants:
            s = self.share(tenant, weight)
            if best_share is None or s < best_share:
                best, best_share = tenant, s
        return best

    def most_over_share(self, tenants: Iterable[tuple[str | None, float]]) -> str | None:
        """Of (tenant, weight) pairs, the tenant with the most weighted service (the last of equals,
        so that with equal shares the newest sequence goes, as without tenants)."""
        worst, worst_share = None, None
        for tenant, weight in tenants:
            s = self.share(tenant, weight)
            if worst_share is None or s >= worst_share:
                worst, worst_share = tenant, s
        return worst
