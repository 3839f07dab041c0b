"""The engine loop's body, synchronous and thread-confined: one `step()` schedules, runs the model,
samples and post-processes, and returns the deliveries for the asyncio side.

Other threads talk to it only through `add()` and `abort()`, which queue work for the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from opentgi.engine.block_manager import BlockManager
from opentgi.engine.errors import GenerationError
from opentgi.engine.events import PrefillToken
from opentgi.engine.observer import EngineObserver
from opentgi.engine.output_processor import OutputProcessor
from opentgi.engine.request import FinishReason
from opentgi.engine.request_state import Delivery, RequestState
from opentgi.engine.sampler import Sampler
from opentgi.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, *, runner, scheduler: Scheduler, block_manager: BlockManager, sampler: Sampler,
                 tokenizer, observer: EngineObserver | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.sampler = sampler
        self.output = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer
        self.observer = observer or EngineObserver()
        self.requests: dict[str, RequestState] = {}
        self._inbox: deque[RequestState] = deque()
        self._aborts: deque[str] = deque()
        self.wakeup = threading.Event()
        self.steps_total = 0
        self.last_step_at = time.monotonic()
        self.peak_tokens_running = 0
        self._reported_prefix = (0, 0)  # (hit, query) tokens already told to the observer
        self._busy = False  # the observer was told of a batch and not yet that the engine is idle

    # --- from other threads ----------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        self._inbox.append(state)
        self.wakeup.set()

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self.wakeup.set()

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.scheduler.has_work())

    # --- the step ------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while self._aborts:
            state = self.requests.pop(self._aborts.popleft(), None)
            if state is not None:
                self._release(state)
        while self._inbox:
            state = self._inbox.popleft()
            if state.done:  # cancelled before it was ever scheduled
                continue
            self.requests[state.request_id] = state
            for seq in state.seqs:
                self.scheduler.add(seq)
        self.observer.on_queue_size(self.scheduler.num_waiting)

    def _release(self, state: RequestState) -> None:
        state.done = True
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                self.runner.free(seq)

    def step(self) -> list[Delivery]:
        self._drain_inbox()
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.runner.free(seq)
        if out.preempted:
            self.observer.on_preemption(len(out.preempted))
        if out.is_empty:
            self._report_idle()
            return []
        started = time.monotonic()
        # as TGI's tgi_batch_current_max_tokens: what the running batch may hold (prompt +
        # max_new_tokens of each running sequence); constant while tokens are generated
        committed = self.tokens_committed_running()
        self.peak_tokens_running = max(self.peak_tokens_running, committed)
        seqs, num_new = out.seqs, out.num_new_tokens
        sample_rows: list[int] = []
        logit_rows: list[int] = []
        score_rows: list[int] = []
        for row, (seq, n) in enumerate(zip(seqs, num_new)):
            completes = n == seq.num_uncomputed_tokens
            if seq.request.score:
                if completes:
                    score_rows.append(row)
            elif completes:
                sample_rows.append(row)
            if seq.prompt_logprobs is not None and seq.index == 0 \
                    and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1 \
                    and seq.num_computed_tokens < seq.num_prompt_tokens:
                logit_rows.append(row)
            state = self.requests[seq.request.request_id]
            if state.timings.scheduled_at is None:
                state.timings.scheduled_at = started
        if out.concat_reason is not None:
            self.observer.on_batch_concat(reason=out.concat_reason)
        deliveries: dict[str, Delivery] = {}
        forward_s = decode_s = filter_s = None
        try:
            result = self.runner.execute(seqs, num_new, sample_rows, logit_rows, score_rows)
            for seq, n in zip(seqs, num_new):
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)
            for row in logit_rows:
                self._prompt_logprobs(seqs[row], num_new[row], result.position_logits[row])
            finished = []  # (seq, state): removed after the step's events are built
            for row in score_rows:
                finished.append(self._finish_score(seqs[row], result.scores[row]))
            sampled = [seqs[r] for r in sample_rows]
            sout = self.sampler.sample(sampled, result.sample_logits) if sampled else None
            # TGI's split: forward = model + token choice, decode = detokenize + stop checks,
            # filter = removing the finished sequences from the batch
            decode_at = time.monotonic()
            forward_s = decode_at - started
            for i, seq in enumerate(sampled):
                event = self.output.process(seq, sout.token_ids[i], sout.logprobs[i], sout.top[i])
                state = self.requests[seq.request.request_id]
                if state.timings.first_token_at is None:
                    state.timings.first_token_at = decode_at
                state.events[seq.index].append(event)
                self._delivery(state, deliveries).events.append(event)
                if event.finish_reason is not None:
                    finished.append((seq, state))
            filter_at = time.monotonic()
            decode_s = filter_at - decode_at
            for seq, state in finished:
                self._finish_seq(seq, state, deliveries)
            filter_s = time.monotonic() - filter_at
            ok = True
        except Exception as exc:  # the model failed: fail this step's requests, keep serving the rest
            log.exception("engine step failed")
            ok = False
            for seq in seqs:
                state = self.requests.pop(seq.request.request_id, None)
                if state is not None:
                    self._release(state)
                    self._delivery(state, deliveries).error = GenerationError(f"generation failed: {exc}")
                    self._report_finished(state, ok=False)
        self.steps_total += 1
        self.last_step_at = time.monotonic()
        duration = self.last_step_at - started
        bm = self.block_manager
        self.observer.on_batch(method="prefill" if out.has_prefill else "decode", size=len(seqs),
                               max_tokens=committed, duration_s=duration, ok=ok,
                               forward_s=forward_s, decode_s=decode_s, filter_s=filter_s,
                               next_size=out.num_admitted)
        self._busy = True
        self.observer.on_kv_blocks(used=bm.num_used_blocks, free=bm.num_free_blocks, cached=bm.num_cached_blocks)
        if (bm.prefix_hit_tokens, bm.prefix_query_tokens) != self._reported_prefix:
            self._reported_prefix = (bm.prefix_hit_tokens, bm.prefix_query_tokens)
            self.observer.on_prefix_cache(hit_tokens=bm.prefix_hit_tokens, query_tokens=bm.prefix_query_tokens)
        self._report_idle()
        return list(deliveries.values())

    def _report_idle(self) -> None:
        """TGI zeroes tgi_batch_current_size / _max_tokens once its batch is empty."""
        if self._busy and not self.scheduler.running:
            self._busy = False
            self.observer.on_idle()

    # --- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _delivery(state: RequestState, deliveries: dict[str, Delivery]) -> Delivery:
        d = deliveries.get(state.request_id)
        if d is None:
            d = deliveries[state.request_id] = Delivery(state)
        return d

    def _prompt_logprobs(self, seq, n: int, logits: torch.Tensor) -> None:
        start = seq.num_computed_tokens - n  # already advanced
        # logits[j] (position start+j) predicts token start+j+1, for targets inside the prompt
        m = min(n, seq.num_prompt_tokens - 1 - start)
        if m <= 0:
            return
        targets = torch.tensor(seq.token_ids[start + 1:start + 1 + m], device=logits.device)
        lp = torch.log_softmax(logits[:m].float(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        have = len(seq.prompt_logprobs)
        new = lp.tolist()
        # a recompute after preemption covers positions already reported
        seq.prompt_logprobs.extend(new[max(0, have - start):])

    def _finish_score(self, seq, score: float) -> tuple:
        state = self.requests[seq.request.request_id]
        seq.score = score
        state.score = score
        seq.finish_reason = FinishReason.LENGTH
        return seq, state

    def _finish_seq(self, seq, state: RequestState, deliveries) -> None:
        self.scheduler.finish(seq)
        self.runner.free(seq)
        state.num_unfinished -= 1
        if state.num_unfinished == 0:
            self.requests.pop(state.request_id, None)
            state.done = True
            state.timings.finished_at = time.monotonic()
            if state.request.prompt_logprobs:
                state.prefill = self._prefill_tokens(state.seqs[0])
            self._delivery(state, deliveries).result = state.build_result()
            self._report_finished(state, ok=True)

    def _report_finished(self, state: RequestState, ok: bool) -> None:
        t = state.timings
        end = t.finished_at or time.monotonic()
        started = t.scheduled_at or end
        self.observer.on_request_finished(
            request_id=state.request_id, ok=ok, input_tokens=state.request.num_prompt_tokens,
            generated_tokens=sum(s.num_generated_tokens for s in state.seqs),
            queue_s=started - t.queued_at, inference_s=end - started)

    def _prefill_tokens(self, seq) -> list[PrefillToken]:
        ids = seq.token_ids[:seq.num_prompt_tokens]
        lps = [None] + list(seq.prompt_logprobs)
        return [PrefillToken(id=t, text=self.output.token_text(t), logprob=lp) for t, lp in zip(ids, lps)]

    def tokens_committed_running(self) -> int:
        """Sum over running sequences of the tokens they hold plus those they may still generate."""
        total = 0
        for seq in self.scheduler.running:
            total += len(seq) + max(0, seq.max_new_tokens - seq.num_generated_tokens)
        return total
