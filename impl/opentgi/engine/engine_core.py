"""The engine loop's body, synchronous and thread-confined: one `step()` schedules, runs the model,
samples, lets the scheduler update from the output (the scheduler alone touches the block
manager), then detokenizes and checks stop conditions, and returns the deliveries for the asyncio
side.

Other threads talk to it only through `add()` and `abort()`, which queue work for the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from opentgi.engine.errors import GenerationError
from opentgi.engine.events import PrefillToken
from opentgi.engine.observer import EngineObserver
from opentgi.engine.output.output_processor import OutputProcessor
from opentgi.engine.request import FinishReason
from opentgi.engine.sampling.sampler import Sampler, SamplerOutput
from opentgi.engine.sampling.speculative import verify
from opentgi.engine.scheduling.request_state import Delivery, RequestState
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from opentgi.engine.scheduling.sequence import Sequence
from opentgi.engine.scheduling.step_plan import RowTokens, StepPlan

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, *, runner, scheduler: Scheduler, sampler: Sampler, tokenizer,
                 observer: EngineObserver | None = None):
        self.runner = runner
        self.scheduler = scheduler  # the only owner of the block manager
        self.sampler = sampler
        self.output = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer
        self.observer = observer or EngineObserver()
        self.requests: dict[str, RequestState] = {}
        self._inbox: deque[RequestState] = deque()
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # run between two steps
        self.wakeup = threading.Event()
        self.steps_total = 0
        self.last_step_at = time.monotonic()
        self.peak_tokens_running = 0
        self.step_tokens = 0  # tokens the current (or last) step computes
        self._reported_prefix = (0, 0)  # (hit, query) tokens already told to the observer
        self._busy = False  # the observer was told of a batch and not yet that the engine is idle

    # --- from other threads ----------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        self._inbox.append(state)
        self.wakeup.set()

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self.wakeup.set()

    def call_between_steps(self, fn: Callable[[], object]) -> Future:
        """Runs `fn` on the engine thread before the next step (nothing runs the model meanwhile):
        how the model is changed while serving (LoRA adapters loaded at run time)."""
        future: Future = Future()
        self._calls.append((fn, future))
        self.wakeup.set()
        return future

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self._calls or self.scheduler.has_work())

    # --- the step ------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)
        aborted = set()
        while self._aborts:
            request_id = self._aborts.popleft()
            aborted.add(request_id)
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._release(state)
        while self._inbox:
            state = self._inbox.popleft()
            if state.done or state.request_id in aborted:  # cancelled before it was ever scheduled
                state.done = True
                continue
            self.requests[state.request_id] = state
            for seq in state.seqs:
                self.scheduler.add(seq)
        self.observer.on_queue_size(self.scheduler.num_waiting)
        if aborted:  # the gauges show the freed blocks now, not after the next batch
            bm = self.scheduler.block_manager
            self.observer.on_kv_blocks(used=bm.num_used_blocks, free=bm.num_free_blocks, cached=bm.num_cached_blocks)

    def _release(self, state: RequestState) -> None:
        state.done = True
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                self.runner.free(seq)

    def step(self) -> list[Delivery]:
        """schedule -> run the model -> sample -> the scheduler updates from the output -> text
        and stop conditions -> finished sequences leave -> report."""
        self._drain_inbox()
        out = self.scheduler.schedule()
        self.step_tokens = out.num_tokens  # the watchdog's allowance for this step (Engine.stall_limit_s)
        self._on_preempted(out.preempted)
        if out.is_empty:
            self._report_idle()
            return []
        plan = self._plan(out)
        deliveries: dict[str, Delivery] = {}
        try:
            result = self.runner.execute(out.seqs, out.num_new_tokens, plan.sample_rows, plan.logit_rows,
                                         plan.score_rows, greedy_vocab=self._greedy_vocab(out, plan))
            tokens = self._sample(out, plan, result)
            plan.timings.forward_done()
            self.scheduler.update_from_output(out, tokens.token_ids)
            finished = self._process_outputs(out, plan, result, tokens, deliveries)
            plan.timings.decode_done()
            for seq, state in finished:
                self._finish_seq(seq, state, deliveries)
            plan.timings.filter_done()
            ok = True
        except Exception as exc:  # the model failed: fail this step's requests, keep serving the rest
            log.exception("engine step failed")
            ok = False
            self._fail_step(out.seqs, exc, deliveries)
        self._report_step(out, plan, ok)
        return list(deliveries.values())

    # --- the step's parts ------------------------------------------------------------------------
    def _plan(self, out: SchedulerOutput) -> StepPlan:
        started = time.monotonic()
        # as TGI's tgi_batch_current_max_tokens: what the running batch may hold (prompt +
        # max_new_tokens of each running sequence); constant while tokens are generated
        committed = self.tokens_committed_running()
        self.peak_tokens_running = max(self.peak_tokens_running, committed)
        for seq in out.seqs:
            timings = self.requests[seq.request.request_id].timings
            if timings.scheduled_at is None:
                timings.scheduled_at = started
        if out.concat_reason is not None:
            self.observer.on_batch_concat(reason=out.concat_reason)
        return StepPlan.of(out, started, committed)

    def _on_preempted(self, preempted: list[Sequence]) -> None:
        for seq in preempted:
            self.runner.free(seq)
        if preempted:
            self.observer.on_preemption(len(preempted))

    def _greedy_vocab(self, out: SchedulerOutput, plan: StepPlan) -> int:
        """The vocabulary size where each sampled row's token is the argmax of its logits and
        nothing else of them is used (no drafts, processors or logprobs): the runner may then
        return the tokens alone. Else 0."""
        sampled = [out.seqs[r] for r in plan.sample_rows]
        if not sampled or any(s.draft_token_ids for s in sampled):
            return 0
        batch = self.sampler.batch_for(sampled)
        return self.sampler.vocab_size if batch.plain_greedy and not batch.any_logprobs else 0

    def _sample(self, out: SchedulerOutput, plan: StepPlan, result) -> RowTokens:
        """The chosen tokens of each scheduled row ([] for rows that sample nothing this step)."""
        tokens = RowTokens.empty(len(out.seqs))
        if not plan.sample_rows:
            return tokens
        sampled = [out.seqs[r] for r in plan.sample_rows]
        drafts = [s.draft_token_ids for s in sampled]
        if any(drafts):
            vout = verify(self.sampler, sampled, drafts, result.sample_logits)
            for i, row in enumerate(plan.sample_rows):
                tokens.token_ids[row], tokens.logprobs[row], tokens.top[row] = \
                    vout.token_ids[i], vout.logprobs[i], vout.top[i]
            self.observer.on_speculation(draft_tokens=[len(d) for d in drafts],
                                         accepted_tokens=[len(t) - 1 for t in vout.token_ids])
            return tokens
        if result.sample_tokens is not None:  # the runner's argmax (_greedy_vocab): the whole answer
            sout = SamplerOutput(result.sample_tokens, [None] * len(sampled), [None] * len(sampled))
        else:
            sout = self.sampler.sample(sampled, result.sample_logits)
        if self.scheduler.proposer is not None:  # TGI records every generation's skipped tokens
            self.observer.on_speculation(draft_tokens=[0] * len(sampled), accepted_tokens=[0] * len(sampled))
        for i, row in enumerate(plan.sample_rows):
            tokens.token_ids[row] = [sout.token_ids[i]]
            tokens.logprobs[row] = [sout.logprobs[i]]
            tokens.top[row] = [sout.top[i]]
        return tokens

    def _process_outputs(self, out: SchedulerOutput, plan: StepPlan, result, tokens: RowTokens,
                         deliveries: dict[str, Delivery]) -> list[tuple[Sequence, RequestState]]:
        """Prompt logprobs, scores, and for every sampled row its events: detokenized text and stop
        conditions. Returns the sequences that finished, (seq, state)."""
        seqs, num_new = out.seqs, out.num_new_tokens
        for row in plan.logit_rows:
            self._prompt_logprobs(seqs[row], num_new[row], result.position_logits[row])
        finished = [self._finish_score(seqs[row], result.scores[row]) for row in plan.score_rows]
        now = time.monotonic()
        for row in plan.sample_rows:
            seq = seqs[row]
            state = self.requests[seq.request.request_id]
            if state.timings.first_token_at is None:
                state.timings.first_token_at = now
            # a request only awaited to its end gets no delivery a step (no event-loop work)
            delivery = self._delivery(state, deliveries) if state.handle.streams else None
            ids = tokens.token_ids[row]
            base = len(seq.token_ids) - len(ids)  # the row's tokens were appended by the scheduler
            for j in range(len(ids)):
                event = self.output.process(seq, base + j + 1, tokens.logprobs[row][j], tokens.top[row][j])
                state.events[seq.index].append(event)
                if delivery is not None:
                    delivery.events.append(event)
                if event.finish_reason is not None:
                    del seq.token_ids[base + j + 1:]  # accepted tokens past the end are dropped
                    finished.append((seq, state))
                    break
        return finished

    def _fail_step(self, seqs: list[Sequence], exc: Exception, deliveries: dict[str, Delivery]) -> None:
        for seq in seqs:
            state = self.requests.pop(seq.request.request_id, None)
            if state is not None:
                self._release(state)
                self._delivery(state, deliveries).error = GenerationError(f"generation failed: {exc}")
                self._report_finished(state, ok=False)

    def _report_step(self, out: SchedulerOutput, plan: StepPlan, ok: bool) -> None:
        self.steps_total += 1
        self.last_step_at = time.monotonic()
        t = plan.timings
        bm = self.scheduler.block_manager
        self.observer.on_batch(method="prefill" if out.has_prefill else "decode", size=len(out.seqs),
                               max_tokens=plan.committed, duration_s=self.last_step_at - t.started, ok=ok,
                               forward_s=t.forward_s, decode_s=t.decode_s, filter_s=t.filter_s,
                               next_size=out.num_admitted)
        self._busy = True
        self.observer.on_kv_blocks(used=bm.num_used_blocks, free=bm.num_free_blocks, cached=bm.num_cached_blocks)
        if (bm.prefix_hit_tokens, bm.prefix_query_tokens) != self._reported_prefix:
            self._reported_prefix = (bm.prefix_hit_tokens, bm.prefix_query_tokens)
            self.observer.on_prefix_cache(hit_tokens=bm.prefix_hit_tokens, query_tokens=bm.prefix_query_tokens)
        self._report_idle()

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
