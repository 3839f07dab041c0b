"""Property test of the Scheduler with its BlockManager: a hypothesis state machine adds requests of
random lengths and max_new_tokens, runs steps (the model's work simulated: every row that completes
its tokens gets one new token, as `scheduler.update_from_output` receives them), finishes sequences
at max_new_tokens and aborts random ones. On every step:

- the prefill token budget is never exceeded, the batch-size limit holds,
- a sequence is never both running and waiting (and its status says which),
- reference counts equal the block tables of the running sequences; waiting ones hold no block,
- with a pool large enough for everyone, a sequence at the head of the queue waits at most
  max_waiting_tokens steps (chunked prefill off), or only while running prompts' chunks spend the
  whole prefill budget (on),
and at the end, draining the queue: preempted sequences come back, every request ends exactly once,
and the pool is empty again.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from opentgi.engine.scheduling.sequence import Sequence, SequenceStatus
from tests.helpers.hypothesis_profiles import examples
from tests.helpers.scheduler_driver import check_consistent, check_step, complete_step, new_sequence

MAX_PROMPT = 12
MAX_NEW = 6


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), large_pool=st.booleans(), spare_blocks=st.integers(0, 6),
                budget=st.integers(2, 16), chunked=st.booleans(), max_batch_size=st.sampled_from([None, 1, 2, 4]),
                max_waiting_tokens=st.integers(1, 4))
    def setup(self, block_size, large_pool, spare_blocks, budget, chunked, max_batch_size, max_waiting_tokens):
        # every sequence fits the pool alone (the engine refuses those that cannot)
        need = -(-(MAX_PROMPT + MAX_NEW) // block_size)
        num_blocks = 10_000 if large_pool else need + spare_blocks
        self.large_pool = large_pool and max_batch_size is None
        self.bm = BlockManager(num_blocks, block_size)
        self.config = SchedulerConfig(prefill_budget=max(budget, 1 if chunked else MAX_PROMPT),
                                      chunked_prefill=chunked, max_waiting_tokens=max_waiting_tokens,
                                      max_batch_size=max_batch_size)
        self.sched = Scheduler(self.config, self.bm)
        self.live: list[Sequence] = []
        self.ended: Counter[int] = Counter()
        self.added = 0
        self.head_wait: dict[int, int] = {}  # seq id -> steps at the head of the queue without admission

    @rule(prompt_len=st.integers(1, MAX_PROMPT), max_new=st.integers(1, MAX_NEW), first=st.integers(0, 3))
    def add(self, prompt_len: int, max_new: int, first: int) -> None:
        prompt = [(first + i) % 4 for i in range(prompt_len)]  # shared prefixes now and then
        seq = new_sequence(prompt, max_new)
        self.sched.add(seq)
        self.live.append(seq)
        self.added += 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def abort(self, i: int) -> None:
        seq = self.live[i % len(self.live)]
        self._end(seq)

    def _end(self, seq: Sequence) -> None:
        self.sched.finish(seq)
        self.live.remove(seq)
        self.ended[seq.seq_id] += 1
        self.head_wait.pop(seq.seq_id, None)

    @rule()
    def step(self) -> None:
        sched = self.sched
        head = sched.waiting[0] if sched.waiting else None
        out = sched.schedule()
        check_step(sched, out)
        if head is not None and head.status is SequenceStatus.WAITING and self.large_pool:
            if self.config.chunked_prefill:  # it waits only while running prefills spend the budget
                k = len(out.seqs) - out.num_admitted
                spent = sum(n for n in out.num_new_tokens[:k] if n > 1) + sum(out.num_new_tokens[k:])
                assert spent >= self.config.prefill_budget, (spent, self.config.prefill_budget)
            else:
                waited = self.head_wait.get(head.seq_id, 0) + 1
                self.head_wait[head.seq_id] = waited
                assert waited <= self.config.max_waiting_tokens, (waited, self.config.max_waiting_tokens)
        for seq in complete_step(sched, out):
            self._end(seq)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "sched"):
            check_consistent(self.sched, self.live)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):  # drain: every sequence, preempted or not, comes back and finishes
            if not self.sched.has_work():
                break
            self.step()
        assert not self.live and not self.sched.has_work()
        assert len(self.ended) == self.added and set(self.ended.values()) <= {1}
        assert self.bm.num_used_blocks == 0


SchedulerMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40)
test_scheduler = SchedulerMachine.TestCase
