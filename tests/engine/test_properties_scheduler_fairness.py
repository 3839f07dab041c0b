"""Property test of fair sharing between tenants: hypothesis draws weights and arrival patterns
(which tenant sends a request of what size, and when) and drives the Scheduler with one batch slot
(`max_batch_size=1`, a pool large enough for everyone: no preemption), as the engine would.

The issue asked that over any window in which two tenants both wait, their served tokens divided by
their weights differ by at most one request's worth. Counted over that window only, this does not
hold, by design: the scheduler compares service over the fair-share window (`FairShare.window_s`),
so a tenant that arrives after another was served alone is admitted every time until it has caught
up, and over the both-waiting window it gets many requests' worth more. What the scheduler
guarantees, and this test checks, is over shares as `FairShare` counts them (tokens computed for
the tenant, prompt + max_new - 1 per finished request, divided by its weight). Let D be tenant a's
share minus tenant b's, read whenever the slot is free, and R the largest weighted size of a's and
b's requests. Then over any stretch in which both have requests waiting:

    |D| <= max(|D when the stretch began|, R)

so tenants whose shares are within one request's worth when both start waiting (both new, or
caught up) stay within one request's worth for as long as both wait; a tenant further behind is
admitted before the other every time until it is within one request's worth, the gap shrinking by
a whole request each time. Read in the middle of a request, D may be off by that request's part.
A third tenant's requests do not change D. The test's window is longer than the run; the server's
is 60 s, past which service ages out of both shares (and D moves with it).
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.fair_share import FairShare
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from tests.helpers.hypothesis_profiles import examples
from tests.helpers.scheduler_driver import check_step, complete_step, new_sequence

TENANTS = ("a", "b", "c")
MAX_PROMPT = 12
MAX_NEW = 8

arrivals = st.lists(st.tuples(st.integers(0, 12), st.sampled_from(TENANTS), st.integers(1, MAX_PROMPT),
                              st.integers(1, MAX_NEW)), min_size=2, max_size=30)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=examples(100))
@given(weights=st.tuples(*[st.sampled_from([0.5, 1.0, 2.0, 3.0])] * len(TENANTS)), arrivals=arrivals,
       chunked=st.booleans(), budget=st.integers(2, 16))
def test_weighted_service_of_two_waiting_tenants_stays_within_one_request(weights, arrivals, chunked, budget):
    weight = dict(zip(TENANTS, weights))
    clock = Clock()
    config = SchedulerConfig(prefill_budget=budget if chunked else MAX_PROMPT, chunked_prefill=chunked,
                             max_batch_size=1)
    sched = Scheduler(config, BlockManager(10_000, 4), FairShare(window_s=1e9, clock=clock))
    fair = sched.fair_share
    worth: dict[str, float] = dict.fromkeys(TENANTS, 0.0)  # largest weighted request size so far
    # pair -> |D| when its both-waiting stretch began; absent: not both waiting
    start_gap: dict[tuple[str, str], float] = {}
    waiting_after: set[str] = set()  # tenants still waiting after the last step's admission
    due = []  # (step, tenant, prompt_len, max_new)
    step_at = 0
    for gap, tenant, prompt_len, max_new in arrivals:
        step_at += gap
        due.append((step_at, tenant, prompt_len, max_new))
    due.reverse()
    first = itertools.count(0, 100)  # distinct prompts: no prefix cache sharing
    for step in range(10_000):
        while due and due[-1][0] <= step:
            _, tenant, prompt_len, max_new = due.pop()
            start = next(first)
            sched.add(new_sequence(list(range(start, start + prompt_len)), max_new, tenant, weight[tenant]))
            worth[tenant] = max(worth[tenant], (prompt_len + max_new - 1) / weight[tenant])
        if not sched.has_work():
            if not due:
                break
            continue
        clock.now += 0.25
        if not sched.running:  # the slot is free: an admission point
            waiting = set(sched.waiting_tenants)
            shares = {t: fair.share(t, weight[t]) for t in waiting}
            for a, b in itertools.combinations(sorted(waiting), 2):
                gap_now = abs(shares[a] - shares[b])
                if (a, b) not in start_gap or not {a, b} <= waiting_after:  # the stretch begins
                    start_gap[(a, b)] = gap_now
                bound = max(start_gap[(a, b)], worth[a], worth[b])
                assert gap_now <= bound + 1e-9, (a, b, shares, start_gap[(a, b)], worth)
            out = sched.schedule()
            admitted = out.seqs[0].request.tenant
            assert shares[admitted] == min(shares.values()), (admitted, shares)  # the one furthest behind
        else:
            out = sched.schedule()
        check_step(sched, out)
        waiting_after = set(sched.waiting_tenants)
        for seq in complete_step(sched, out):
            sched.finish(seq)
        for pair in [p for p in start_gap if not set(p) <= waiting_after]:
            del start_gap[pair]
    assert not sched.has_work() and not due
