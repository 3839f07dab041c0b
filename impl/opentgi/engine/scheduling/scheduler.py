"""Continuous batching: which sequences run this step, and how many of their tokens.

Every step runs all running sequences (a decode is one token; a prompt still being prefilled or
recomputed gets a chunk of the step's prefill budget), then admits waiting sequences into what is
left of the budget. Knobs, with TGI's meaning:

- prefill budget per step: `chunked_prefill_tokens` (capped by `max_batch_prefill_tokens`); with
  chunking off, `max_batch_prefill_tokens` and a new prompt is prefilled whole in one step; a
  chunk never ends inside an image whose tokens attend each other both ways (`whole_images`);
- `max_waiting_tokens` / `waiting_served_ratio` (chunking off): while sequences are running, new
  ones are admitted only when at least `waiting_served_ratio` x running are waiting, or after
  `max_waiting_tokens` steps without admission. With chunked prefill, as in TGI v3, the rule is
  off: a new prompt's chunk rides along with the decodes instead of pausing them;
- `max_batch_size`: running sequences at most;
- the KV pool (`max_batch_total_tokens`): when a running sequence needs a block and none is free,
  the newest running sequence is preempted (its blocks freed, recomputed later from its tokens).
  The oldest running sequence can always proceed, since every sequence fits the pool alone (the
  engine rejects those that cannot up front), so the loop never deadlocks;
- `num_speculative_tokens` (`--speculate`): a running decode that `can_speculate` also feeds up to
  that many n-gram drafts (engine/sampling/speculative.py), verified by the same forward. Drafts never
  exceed what the sequence may still generate, so a sequence alone still always fits the pool.

Tenants (`--tenants`, `GenerationRequest.tenant`): every computed token is service for the
sequence's tenant (`FairShare`, engine/scheduling/fair_share.py). Admission takes the waiting
sequence of the tenant furthest below its weighted share, first-come within a tenant; preemption
takes the newest not-yet-scheduled sequence of the tenant most over its share. With one tenant in
play (every request without one, as without `--tenants`) both are exactly first-come: the queue's
head is admitted, the newest running sequence preempted.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from opentgi.engine.sampling.speculative import NgramProposer, can_speculate
from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.fair_share import FairShare
from opentgi.engine.scheduling.sequence import Sequence, SequenceStatus


def whole_images(seq: Sequence, n: int) -> int:
    """n of seq's uncomputed tokens, or fewer or more so that the chunk never ends inside an image
    whose tokens attend each other both ways (Gemma 3): it ends before the image, or where the
    image starts the chunk (or a cached prefix ended inside it), after it."""
    start = seq.num_computed_tokens
    for image in seq.request.images:
        if image.bidirectional and image.start < start + n < image.end:
            return image.start - start if image.start > start else image.end - start
    return n


@dataclass
class SchedulerConfig:
    prefill_budget: int  # prompt tokens per step
    chunked_prefill: bool
    max_waiting_tokens: int = 20
    waiting_served_ratio: float = 1.2
    max_batch_size: int | None = None
    watermark_blocks: int = 0  # admissions leave this many blocks free for running decodes
    share_prefix: bool = True  # reuse cached KV blocks (False on the generic path: HF caches)
    num_speculative_tokens: int = 0  # n-gram drafts per running decode (0: no speculation)


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_admitted: int = 0  # sequences taken from the waiting queue this step (TGI's next batch size)
    # Why waiting sequences joined sequences already running (TGI's tgi_batch_concat reason), None
    # when nothing joined a running batch: "backpressure" when enough were waiting
    # (waiting_served_ratio), "wait_exceeded" when max_waiting_tokens steps passed without admission
    # or, with chunked prefill, always (TGI v3 has no minimum batch size when it chunks).
    concat_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def has_prefill(self) -> bool:
        return any(n - len(s.draft_token_ids) > 1 for s, n in zip(self.seqs, self.num_new_tokens)) \
            or self.num_admitted > 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, fair_share: FairShare | None = None):
        self.config = config
        self.block_manager = block_manager
        self.fair_share = fair_share if fair_share is not None else FairShare()
        self.waiting: deque[Sequence] = deque()
        self.waiting_tenants: Counter[str | None] = Counter()  # waiting sequences per tenant
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.steps_since_admission = 0
        self.preemptions_total = 0
        k = config.num_speculative_tokens
        self.proposer = NgramProposer(k) if k > 0 else None
        self.draft_tokens_total = 0  # drafts fed to the model
        self.accepted_tokens_total = 0  # of those, kept

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting_tenants[seq.request.tenant] += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.prefill_budget
        budget = self._schedule_running(out, budget)
        if not out.preempted and self.waiting:
            self._admit_waiting(out, budget)
        if out.num_admitted:
            self.steps_since_admission = 1  # TGI's waiting_tokens restarts at 1 with a new batch
        else:
            self.steps_since_admission += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = seq.num_uncomputed_tokens
            if n > 1:  # prompt chunk or recompute
                n = whole_images(seq, min(n, budget)) if budget > 0 else 0
                if n <= 0:
                    i += 1
                    continue
            elif self.proposer is not None and can_speculate(seq):
                seq.draft_token_ids = self.proposer.propose(seq)
                n += len(seq.draft_token_ids)
            while not bm.allocate_slots(seq, n):
                victim = self._preemption_victim(i)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                if n > 1:
                    budget -= n
                self._serve(out, seq, n)
                i += 1
                continue
            # seq itself was preempted: running[i] is now the one after it (without tenants there
            # is none, since seq was the newest and everything after it went first)
        return budget

    def _serve(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Schedule n of seq's tokens this step, counted as service for its tenant."""
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        request = seq.request
        self.fair_share.serve(request.tenant, request.tenant_weight, n)

    def _preemption_victim(self, i: int) -> Sequence:
        """Of the running sequences not yet scheduled this step (running[i:]), the newest one of
        the tenant most over its share; with one tenant among them, simply the newest."""
        candidates = self.running[i:]
        tenants = _tenants_in_order(candidates)
        if len(tenants) == 1:
            return candidates[-1]
        worst = self.fair_share.most_over_share(tenants.items())
        return next(s for s in reversed(candidates) if s.request.tenant == worst)

    def _next_waiting(self, skipped: set[int]) -> Sequence | None:
        """The waiting sequence to admit next (none of `skipped`, by seq_id): the first in queue
        order of the tenant furthest below its share; with one tenant waiting, the queue's head."""
        firsts: dict[str | None, Sequence] = {}
        for seq in self.waiting:  # until every waiting tenant has its first
            if seq.seq_id not in skipped and seq.request.tenant not in firsts:
                firsts[seq.request.tenant] = seq
                if len(firsts) == len(self.waiting_tenants):
                    break
        if len(firsts) <= 1:
            return next(iter(firsts.values()), None)
        tenants = {t: s.request.tenant_weight for t, s in firsts.items()}
        return firsts[self.fair_share.next_tenant(tenants.items())]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.waiting_tenants[seq.request.tenant] += 1
        out.preempted.append(seq)
        self.preemptions_total += 1

    def _admission_reason(self) -> str | None:
        """Whether waiting sequences may join now: "new_batch" (nothing runs), "wait_exceeded",
        "backpressure", or None (not yet)."""
        if not self.running:
            return "new_batch"
        if self.config.chunked_prefill or self.steps_since_admission >= self.config.max_waiting_tokens:
            return "wait_exceeded"
        if len(self.waiting) >= int(len(self.running) * self.config.waiting_served_ratio):
            return "backpressure"
        return None

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        reason = self._admission_reason()
        if reason is None:
            return
        bm = self.block_manager
        cfg = self.config
        skipped: set[int] = set()  # seq_ids left in the queue this step
        while self.waiting and budget > 0:
            if cfg.max_batch_size is not None and len(self.running) >= cfg.max_batch_size:
                break
            seq = self._next_waiting(skipped)
            if seq is None:
                break
            parent = seq.parent
            if parent is not None and parent.status is SequenceStatus.RUNNING and parent.is_prefilling:
                # n > 1: wait until sequence 0 has computed the prompt, then share its blocks
                skipped.add(seq.seq_id)
                continue
            bm.admit(seq, use_prefix_cache=cfg.share_prefix and seq.prompt_logprobs is None)
            n = seq.num_uncomputed_tokens
            fresh_prompt = seq.num_generated_tokens == 0
            if n > budget and fresh_prompt and not cfg.chunked_prefill and (self.running or out.seqs):
                bm.free(seq)  # a whole prompt must fit this step's budget; try next step
                break
            n = whole_images(seq, min(n, budget))
            watermark = cfg.watermark_blocks if self.running else 0
            if bm.num_new_blocks_needed(seq, n) + watermark > bm.num_free_blocks \
                    or not bm.allocate_slots(seq, n):
                bm.free(seq)
                break
            self._leave_queue(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._serve(out, seq, n)
            out.num_admitted += 1
            budget -= n
        if out.num_admitted and reason != "new_batch":
            out.concat_reason = reason

    # --- after the step ------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, new_token_ids: list[list[int]]) -> None:
        """After the forward: append to each scheduled sequence the tokens chosen for it
        (new_token_ids[row], [] for a prompt chunk that does not complete), advance it past the
        tokens whose k/v the step wrote, and register its newly full blocks in the prefix cache.
        A speculated row keeps the k/v of its accepted drafts only: those of rejected drafts lie
        past its computed tokens (never hashed, overwritten later) and the blocks that held
        nothing else are given back."""
        bm = self.block_manager
        for seq, n, tokens in zip(out.seqs, out.num_new_tokens, new_token_ids):
            if tokens:
                seq.token_ids.extend(tokens)
            num_drafts = len(seq.draft_token_ids)
            if num_drafts:
                # fed: the last token + the drafts; kept: all but the last of `tokens` were drafts
                n = len(tokens)
                self.draft_tokens_total += num_drafts
                self.accepted_tokens_total += n - 1
                seq.draft_token_ids = []
            seq.num_computed_tokens += n
            bm.commit(seq)
            if num_drafts:
                bm.trim(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or cancelled) sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self._leave_queue(seq)
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.FINISHED
        if self.proposer is not None:
            self.proposer.forget(seq)

    def _leave_queue(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        tenant = seq.request.tenant
        self.waiting_tenants[tenant] -= 1
        if not self.waiting_tenants[tenant]:
            del self.waiting_tenants[tenant]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)


def _tenants_in_order(seqs: list[Sequence]) -> dict[str | None, float]:
    """The tenants of `seqs` in order of first appearance, with their weights."""
    tenants: dict[str | None, float] = {}
    for seq in seqs:
        tenants.setdefault(seq.request.tenant, seq.request.tenant_weight)
    return tenants
