"""Property test of the Scheduler with tenants: a hypothesis state machine adds requests of random
tenants, weights and lengths under a small KV pool (so fair preemption runs), steps, and aborts
random ones. On every step the budget and batch-size limits hold, a sequence is running or waiting
(never both), reference counts equal the running block tables; within a tenant sequences are first
admitted in the order they came; and draining at the end ends every request exactly once and empties
the pool, however preemption chose its victims.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.fair_share import FairShare
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from opentgi.engine.scheduling.sequence import Sequence
from tests.helpers.hypothesis_profiles import examples
from tests.helpers.scheduler_driver import check_consistent, check_step, complete_step, new_sequence

MAX_PROMPT = 10
MAX_NEW = 6
TENANTS = {"a": 1.0, "b": 2.0, "c": 0.5, None: 1.0}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class TenantSchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), spare_blocks=st.integers(0, 8), budget=st.integers(2, 16),
                max_batch_size=st.sampled_from([None, 1, 3]))
    def setup(self, block_size, spare_blocks, budget, max_batch_size):
        need = -(-(MAX_PROMPT + MAX_NEW) // block_size)  # every sequence fits the pool alone
        self.bm = BlockManager(need + spare_blocks, block_size)
        self.config = SchedulerConfig(prefill_budget=budget, chunked_prefill=True, max_batch_size=max_batch_size)
        self.clock = Clock()
        self.sched = Scheduler(self.config, self.bm, FairShare(window_s=5.0, clock=self.clock))
        self.live: list[Sequence] = []
        self.ended: Counter[int] = Counter()
        self.added: dict[str | None, list[int]] = {t: [] for t in TENANTS}
        self.first_admitted: dict[str | None, list[int]] = {t: [] for t in TENANTS}
        self.num_dropped = 0

    @rule(prompt_len=st.integers(1, MAX_PROMPT), max_new=st.integers(1, MAX_NEW),
          tenant=st.sampled_from(list(TENANTS)))
    def add(self, prompt_len: int, max_new: int, tenant: str | None) -> None:
        seq = new_sequence([len(self.ended) + i for i in range(prompt_len)], max_new, tenant, TENANTS[tenant])
        self.sched.add(seq)
        self.live.append(seq)
        self.added[tenant].append(seq.seq_id)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def abort(self, i: int) -> None:
        self._end(self.live[i % len(self.live)])

    def _end(self, seq: Sequence) -> None:
        self.sched.finish(seq)
        self.live.remove(seq)
        self.ended[seq.seq_id] += 1
        tenant = seq.request.tenant
        if seq.seq_id not in self.first_admitted[tenant]:  # aborted while waiting: out of the order
            self.added[tenant].remove(seq.seq_id)
            self.num_dropped += 1

    @rule()
    def step(self) -> None:
        self.clock.now += 0.5
        sched = self.sched
        out = sched.schedule()
        check_step(sched, out)
        for seq in out.seqs:
            tenant = seq.request.tenant
            if seq.seq_id not in self.first_admitted[tenant]:
                self.first_admitted[tenant].append(seq.seq_id)
        for tenant, admitted in self.first_admitted.items():  # first-come within a tenant
            assert admitted == self.added[tenant][:len(admitted)], tenant
        for seq in complete_step(sched, out):
            self._end(seq)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "sched"):
            return
        check_consistent(self.sched, self.live)
        assert self.sched.waiting_tenants == Counter(s.request.tenant for s in self.sched.waiting)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(3000):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.live and not self.sched.has_work()
        assert sum(len(v) for v in self.added.values()) + self.num_dropped == len(self.ended) and set(self.ended.values()) <= {1}
        assert self.bm.num_used_blocks == 0


TenantSchedulerMachine.TestCase.settings = settings(max_examples=examples(40), stateful_step_count=40)
test_scheduler_with_tenants = TenantSchedulerMachine.TestCase
