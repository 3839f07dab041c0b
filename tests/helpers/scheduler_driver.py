"""Driving a Scheduler without a model, as the scheduler's property tests do: sequences built from
bare requests, the model's work simulated (every row that completes its tokens gets one new token,
as `Scheduler.update_from_output` receives them), and the checks every step must pass."""

from __future__ import annotations

from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from opentgi.engine.scheduling.sequence import Sequence, SequenceStatus


def new_sequence(prompt: list[int], max_new: int, tenant: str | None = None, weight: float = 1.0) -> Sequence:
    req = GenerationRequest(prompt, SamplingParams(), StoppingParams(max_new_tokens=max_new), tenant=tenant,
                            tenant_weight=weight)
    return Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 1 << 20),
                    processors=[])


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """What every step's plan must satisfy: the prefill budget and the batch-size limit hold, no
    sequence is scheduled twice, and each scheduled one runs, with blocks for the tokens it computes."""
    config, bm = sched.config, sched.block_manager
    prefill = sum(n for n in out.num_new_tokens if n > 1)
    assert prefill <= config.prefill_budget, (out.num_new_tokens, config.prefill_budget)
    if config.max_batch_size is not None:
        assert len(sched.running) <= config.max_batch_size
    assert len({id(s) for s in out.seqs}) == len(out.seqs)
    for seq, n in zip(out.seqs, out.num_new_tokens):
        assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_uncomputed_tokens
        assert len(seq.block_table) >= bm.blocks_for(seq.num_computed_tokens + n)


def complete_step(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """The model's part: one token for each row that completes its tokens; returns the scheduled
    sequences that reached max_new_tokens (still to be finished by the caller)."""
    tokens = [[7] if n == seq.num_uncomputed_tokens else [] for seq, n in zip(out.seqs, out.num_new_tokens)]
    sched.update_from_output(out, tokens)
    return [seq for seq in out.seqs if seq.num_generated_tokens >= seq.max_new_tokens]


def check_consistent(sched: Scheduler, live: list[Sequence]) -> None:
    """A live sequence is running or waiting, never both, and its status says which; waiting ones
    hold no block; reference counts equal the block tables of the running sequences."""
    running = {id(s) for s in sched.running}
    waiting = {id(s) for s in sched.waiting}
    assert not running & waiting
    assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
    assert running | waiting == {id(s) for s in live}
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
    holders = [0] * sched.block_manager.num_blocks
    for seq in sched.running:
        for block_id in seq.block_table:
            holders[block_id] += 1
    assert [b.ref_count for b in sched.block_manager.blocks] == holders
