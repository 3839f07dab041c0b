"""Scheduler behaviour without a model: token budgets, chunked prefill next to decodes, TGI's
admission knobs, preemption newest-first, and progress under a tiny KV pool."""

from __future__ import annotations

from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from opentgi.engine.scheduling.sequence import Sequence, SequenceStatus


def make_seq(prompt_len: int, max_new: int = 8, first_token: int = 0) -> Sequence:
    req = GenerationRequest(list(range(first_token, first_token + prompt_len)), SamplingParams(),
                            StoppingParams(max_new_tokens=max_new))
    return Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 1 << 20),
                    processors=[])


def make_scheduler(num_blocks=64, block_size=4, budget=16, chunked=True, **kw) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(prefill_budget=budget, chunked_prefill=chunked, **kw), bm)


def complete_step(sched: Scheduler, out, token: int = 7) -> list[Sequence]:
    """What the engine does after the forward: advance, commit, append sampled tokens, finish."""
    finished = []
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        sched.block_manager.commit(seq)
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(token)
            if seq.num_generated_tokens >= seq.max_new_tokens:
                finished.append(seq)
    for seq in finished:
        sched.finish(seq)
    return finished


def test_chunked_prefill_runs_beside_decodes():
    sched = make_scheduler(budget=8)
    short = make_seq(3)
    sched.add(short)
    out = sched.schedule()
    assert out.num_new_tokens == [3]
    complete_step(sched, out)
    long = make_seq(20, first_token=100)
    sched.add(long)
    out = sched.schedule()
    assert [s is short for s in out.seqs] == [True, False]
    assert out.num_new_tokens == [1, 8]  # the decode, then a chunk of the budget
    complete_step(sched, out)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 8]
    complete_step(sched, out)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 4]  # the rest of the prompt
    complete_step(sched, out)
    assert long.num_generated_tokens == 1


def test_unchunked_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=10, chunked=False, waiting_served_ratio=0.0)
    a, b = make_seq(6), make_seq(6, first_token=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a]  # b does not fit the rest of the budget, and is never split
    complete_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 6]


def late_admission_step(chunked: bool) -> int | None:
    sched = make_scheduler(budget=64, chunked=chunked, max_waiting_tokens=3, waiting_served_ratio=1.2)
    running = [make_seq(2, max_new=100, first_token=10 * i) for i in range(5)]
    for s in running:
        sched.add(s)
    complete_step(sched, sched.schedule())
    late = make_seq(2, max_new=100, first_token=999)
    sched.add(late)
    admitted_at = None
    for step in range(1, 6):
        out = sched.schedule()
        if late in out.seqs:
            admitted_at = step
            break
        complete_step(sched, out)
    return admitted_at


def test_waiting_served_ratio_and_max_waiting_tokens():
    # 1 waiting < 5 running x 1.2: it waits until max_waiting_tokens steps passed without admission
    assert late_admission_step(chunked=False) == 3
    # with chunked prefill the rule is off (TGI v3): admitted at once
    assert late_admission_step(chunked=True) == 1


def test_preemption_takes_newest_and_everyone_finishes():
    # 6 blocks of 4 tokens = 24 tokens; three sequences that need 12 tokens each
    sched = make_scheduler(num_blocks=6, block_size=4, budget=32, waiting_served_ratio=0.0)
    seqs = [make_seq(4, max_new=8, first_token=100 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    finished = []
    preempted = []
    for _ in range(200):
        if not sched.has_work():
            break
        out = sched.schedule()
        preempted += out.preempted
        assert out.seqs, "no progress"
        used = sum(len(s.block_table) for s in sched.running)
        assert used <= 6
        finished += complete_step(sched, out)
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert preempted and preempted[0] is seqs[2]  # the newest goes first
    assert sched.preemptions_total == len(preempted)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(len(s.token_ids) == 12 for s in seqs)
    assert sched.block_manager.num_used_blocks == 0


def test_single_sequence_as_big_as_the_pool_completes():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=2)
    seq = make_seq(5, max_new=7)  # exactly 12 tokens
    other = make_seq(3, max_new=4, first_token=50)
    sched.add(seq)
    sched.add(other)
    for _ in range(100):
        if not sched.has_work():
            break
        complete_step(sched, sched.schedule())
    assert seq.is_finished and other.is_finished


def test_max_batch_size():
    sched = make_scheduler(max_batch_size=2, waiting_served_ratio=0.0)
    for i in range(3):
        sched.add(make_seq(2, first_token=10 * i))
    out = sched.schedule()
    assert len(out.seqs) == 2 and sched.num_waiting == 1


def test_siblings_wait_for_the_prompt_then_share_it():
    sched = make_scheduler(budget=4, waiting_served_ratio=0.0)
    req = GenerationRequest(list(range(13)), SamplingParams(), StoppingParams(max_new_tokens=4), n=2)
    parent = Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 99),
                      processors=[])
    child = Sequence(req, 1, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 99),
                     processors=[], parent=parent)
    sched.add(parent)
    sched.add(child)
    for _ in range(3):  # 12 of 13 prompt tokens, 4 per step: the sibling waits
        out = sched.schedule()
        assert out.seqs == [parent]
        complete_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [parent, child]
    assert child.num_cached_tokens == 12
    assert child.block_table[:3] == parent.block_table[:3]
