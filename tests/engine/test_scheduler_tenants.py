"""Fair sharing between tenants in the scheduler, without a model: who is admitted next when one
tenant floods the queue, first-come within a tenant, weights, and who is preempted under KV pressure."""

from __future__ import annotations

from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.fair_share import FairShare
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from opentgi.engine.scheduling.sequence import Sequence, SequenceStatus

_first_token = iter(range(0, 1 << 30, 100))  # distinct prompts: no prefix cache sharing


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_seq(tenant: str | None, prompt_len: int = 4, max_new: int = 4, weight: float = 1.0) -> Sequence:
    first = next(_first_token)
    req = GenerationRequest(list(range(first, first + prompt_len)), SamplingParams(), StoppingParams(max_new_tokens=max_new),
                            tenant=tenant, tenant_weight=weight)
    return Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 1 << 20),
                    processors=[])


def make_scheduler(clock: Clock, num_blocks=64, block_size=4, budget=64, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(prefill_budget=budget, chunked_prefill=True, **kw),
                     BlockManager(num_blocks, block_size), FairShare(window_s=60.0, clock=clock))


def complete_step(sched: Scheduler, out) -> list[Sequence]:
    """The engine's part after the forward: advance, commit, append a token, finish."""
    finished = []
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        sched.block_manager.commit(seq)
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)
            if seq.num_generated_tokens >= seq.max_new_tokens:
                finished.append(seq)
    for seq in finished:
        sched.finish(seq)
    return finished


def run_until_admitted(sched: Scheduler, clock: Clock) -> list[Sequence]:
    """Steps (one second each) until the scheduler admits something; returns what it admitted."""
    for _ in range(100):
        clock.now += 1.0
        out = sched.schedule()
        admitted = out.seqs[len(out.seqs) - out.num_admitted:]
        complete_step(sched, out)
        if admitted:
            return admitted
    raise AssertionError("nothing was admitted")


def test_a_flooding_tenant_does_not_delay_another_tenants_request():
    clock = Clock()
    sched = make_scheduler(clock, max_batch_size=1)
    alpha = [make_seq("alpha") for _ in range(8)]
    for seq in alpha:
        sched.add(seq)
    assert run_until_admitted(sched, clock) == [alpha[0]]
    beta = make_seq("beta")
    sched.add(beta)  # behind seven of alpha's in the queue
    assert run_until_admitted(sched, clock) == [beta]  # as soon as alpha[0] leaves its slot
    assert run_until_admitted(sched, clock) == [alpha[1]]  # then alpha again, in its own order
    assert [s for s in sched.waiting] == alpha[2:]


def test_without_tenants_admission_is_first_come():
    clock = Clock()
    sched = make_scheduler(clock, max_batch_size=1)
    seqs = [make_seq(None) for _ in range(4)]
    for seq in seqs:
        sched.add(seq)
    assert [run_until_admitted(sched, clock)[0] for _ in seqs] == seqs


def test_within_a_tenant_order_stays_first_come():
    clock = Clock()
    sched = make_scheduler(clock, max_batch_size=1)
    queued = [make_seq(t) for t in ("alpha", "alpha", "beta", "alpha", "beta", "beta")]
    for seq in queued:
        sched.add(seq)
    admitted = [run_until_admitted(sched, clock)[0] for _ in queued]
    for tenant in ("alpha", "beta"):
        assert [s for s in admitted if s.request.tenant == tenant] == \
            [s for s in queued if s.request.tenant == tenant]
    # alternating once both have been served: alpha, beta, then whoever is below its share
    assert [s.request.tenant for s in admitted[:2]] == ["alpha", "beta"]


def test_weights_split_the_service_and_it_stays_within_one_request():
    """Both tenants keep requests waiting; weight 2 gets twice the tokens of weight 1, within one
    request's worth (8 tokens: a 4-token prompt and 4 new tokens) at every step."""
    clock = Clock()
    sched = make_scheduler(clock, max_batch_size=2)
    weights = {"heavy": 2.0, "light": 1.0}
    served = dict.fromkeys(weights, 0)
    for step in range(300):
        for tenant, weight in weights.items():
            while sum(1 for s in sched.waiting if s.request.tenant == tenant) < 2:
                sched.add(make_seq(tenant, weight=weight))
        clock.now += 0.1
        out = sched.schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            served[seq.request.tenant] += n
        complete_step(sched, out)
        if step > 20:
            assert abs(served["heavy"] / 2.0 - served["light"]) <= 8, (step, served)


def test_preemption_takes_from_the_tenant_most_over_its_share():
    clock = Clock()
    # 6 blocks of 4: three 4-token prompts and one more block each fit, the third block each does not
    sched = make_scheduler(clock, num_blocks=6, max_batch_size=3)
    sched.fair_share.serve("alpha", 1.0, 1000)  # alpha has had far more than beta lately
    alpha = [make_seq("alpha", max_new=12) for _ in range(2)]
    for seq in alpha:
        sched.add(seq)
    complete_step(sched, sched.schedule())
    beta = make_seq("beta", max_new=12)
    sched.add(beta)
    preempted = []
    for _ in range(12):
        clock.now += 1.0
        out = sched.schedule()
        preempted += out.preempted
        complete_step(sched, out)
        if preempted:
            break
    # first-come would preempt the newest running sequence, beta's: alpha's newest goes instead
    assert preempted == [alpha[1]]
    assert beta.status is SequenceStatus.RUNNING and alpha[1].status is SequenceStatus.WAITING


def test_service_leaves_the_window():
    clock = Clock()
    share = FairShare(window_s=10.0, clock=clock)
    share.serve("alpha", 2.0, 100)
    assert share.share("alpha") == 50.0
    clock.now += 5.0
    share.serve("alpha", 2.0, 10)
    assert share.served("alpha") == 110
    clock.now += 6.5
    assert share.served("alpha") == 10  # the first second's 100 tokens are older than 10 s
    clock.now += 10.0
    assert share.served("alpha") == 0
    assert share.next_tenant([("alpha", 1.0), ("beta", 1.0)]) == "alpha"  # equal: the first
