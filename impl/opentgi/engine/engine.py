"""The engine front: `submit(request)` from asyncio, the model in its own thread.

    engine = Engine.from_settings(settings)   # loads the model, sizes the KV pool
    await engine.start()
    handle = await engine.submit(request)      # GenerationRequest -> RequestHandle
    async for event in handle: ...             # TokenEvents, all sequences interleaved
    result = await handle.result()

The loop thread runs `EngineCore.step()` while there is work and hands each step's deliveries to
the event loop with one `loop.call_soon_threadsafe`; HTTP handlers never wait on torch.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import threading
import time
import weakref

import torch

from opentgi.config import Settings
from opentgi.engine.engine_core import EngineCore
from opentgi.engine.errors import (
    GenerationError,
    InputTooLongError,
    NotSupportedError,
    OverloadedError,
    UnhealthyError,
    UnknownAdapterError,
    ValidationError,
)
from opentgi.engine.execution import torch_threads
from opentgi.engine.execution.assembly import build_info, build_runner
from opentgi.engine.execution.kv_cache import cache_growth_limit
from opentgi.engine.execution.thread_governor import ThreadGovernor
from opentgi.engine.handle import RequestHandle
from opentgi.engine.info import ChatTemplate, EngineInfo, EngineStats, TokenizedText
from opentgi.engine.observer import EngineObserver
from opentgi.engine.output.detokenizer import IncrementalDetokenizer
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, ImageData, ImageInput, SamplingParams, StoppingParams
from opentgi.engine.sampling.sampler import Sampler
from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.engine.scheduling.request_state import Delivery, RequestState
from opentgi.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from opentgi.engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)

# A step running longer than STALL_AFTER_S plus STALL_PER_TOKEN_S for each token it computes fails
# what is in flight (the engine is unhealthy): a decode step has minutes, a prompt chunk of 512 tokens
# on a large model and a slow CPU the time it honestly needs.
STALL_AFTER_S = 120.0
STALL_PER_TOKEN_S = 0.5
WATCHDOG_INTERVAL_S = 0.25  # how often the watchdog looks at the loop thread
BUSY_VOUCHES_S = 5.0  # a step that ended this recently, with sequences running, vouches for health

__all__ = ["Engine", "EngineInfo", "EngineStats"]


_loop_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its copy


def _private_copy(tokenizer):
    """One copy per tokenizer, made once (it costs a few hundred ms): engine loops over the same
    loaded model may share it, since they only decode with it and nobody reconfigures it."""
    try:
        found = _loop_tokenizers.get(tokenizer)
        if found is None:
            found = _loop_tokenizers[tokenizer] = copy.deepcopy(tokenizer)
        return found
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared as it is
        log.warning("tokenizer cannot be copied; the engine loop shares it", exc_info=True)
        return tokenizer


def _needs_trigger(request: GenerationRequest) -> bool:
    """The request's grammar waits (for the thinking to end, or for a trigger), or a budget closes
    its thinking: engine/sampling/grammar_trigger.py."""
    grammar, reasoning = request.grammar, request.reasoning
    if reasoning is not None and (grammar is not None or reasoning.budget is not None):
        return True
    return grammar is not None and bool(grammar.trigger_token_ids or grammar.end_token_ids or grammar.repeat
                                        or grammar.trigger_at_start)


class Engine:
    def __init__(self, loaded, settings: Settings, observer: EngineObserver | None = None):
        self.settings = settings
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        # The loop thread decodes with its own copy: a Rust tokenizer that another thread is
        # reconfiguring (truncation, padding) raises "Already borrowed" in concurrent calls.
        self._loop_tokenizer = _private_copy(self.tokenizer)
        self.observer = observer or EngineObserver()
        runner, spec, num_blocks, block_size = build_runner(loaded, settings)
        self.runner = runner
        self.spec = spec
        self.info: EngineInfo = build_info(loaded, settings, spec, num_blocks, block_size, runner.kind)
        # images only where the runner has the image encoder (not on the generic or sharded path)
        self.info.image_input = getattr(loaded, "image_prompts", None) is not None and \
            getattr(runner, "vision", None) is not None
        if self.info.image_input:
            self.info.image_marker = loaded.image_prompts.image_token
        info = self.info
        # kernels by row kind: generated tokens' k/v must not serve a later prompt (docs/determinism.md)
        prompt_blocks_only = info.deterministic and getattr(runner, "kernels_by_row_kind", False)
        self.block_manager = BlockManager(num_blocks, block_size, settings.enable_prefix_caching,
                                          cache_growth_limit(settings, spec, block_size, num_blocks),
                                          prompt_blocks_only=prompt_blocks_only)
        chunked = settings.chunked_prefill_tokens is not None
        budget = info.max_batch_prefill_tokens
        if settings.chunked_prefill_tokens is not None:
            budget = max(1, min(settings.chunked_prefill_tokens, budget))
        self.scheduler = Scheduler(SchedulerConfig(
            prefill_budget=budget, chunked_prefill=chunked, max_waiting_tokens=settings.max_waiting_tokens,
            waiting_served_ratio=settings.waiting_served_ratio, max_batch_size=settings.max_batch_size,
            watermark_blocks=max(0, num_blocks // 100), share_prefix=runner.kind == "paged",
            num_speculative_tokens=info.speculate),
            self.block_manager)
        self.sampler = Sampler(spec.vocab_size, torch.device(spec.device))
        self.core = EngineCore(runner=runner, scheduler=self.scheduler, sampler=self.sampler,
                               tokenizer=self._loop_tokenizer, observer=self.observer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._live: dict[str, RequestHandle] = {}
        self._grammar_compiler = None
        self._rng = random.SystemRandom()
        self._step_started_at: float | None = None
        self.stall_after_s = STALL_AFTER_S
        self.stall_per_token_s = STALL_PER_TOKEN_S
        self.failure: str | None = None  # why the engine cannot serve (loop died, step stalled)
        self._watchdog: asyncio.Task | None = None
        self._probes: set[str] = set()  # health probes in flight: not counted against the limit
        self._compiling = 0  # admitted requests still compiling their grammar
        self.grammar_compile_timeout_s: float | None = None  # None: grammar.COMPILE_TIMEOUT_S
        self._max_token_chars: int | None = None  # the vocabulary's longest token, in characters

    @classmethod
    def from_settings(cls, settings: Settings, observer: EngineObserver | None = None) -> Engine:
        """Load the model and build the engine in a thread of their own (engine/execution/torch_threads.py:
        the caller's thread starts no OpenMP team that would slow the loop thread's)."""
        from opentgi.models.loader import load_model

        return torch_threads.call_in_own_thread(lambda: cls(load_model(settings), settings, observer=observer),
                                                settings.num_threads)

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self.failure = None
        self._thread = threading.Thread(target=self._run, name="opentgi-engine", daemon=True)
        self._thread.start()
        self._watchdog = asyncio.create_task(self._watch(), name="opentgi-engine-watchdog")

    async def stop(self) -> None:
        self._stopping = True
        self.core.wakeup.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        self._fail_live("the engine stopped")

    def _run(self) -> None:
        core = self.core
        torch_threads.apply(self.settings.num_threads)
        governor = ThreadGovernor.for_settings(self.settings.num_threads, self.settings.fixed_threads,
                                               self.sampler.device)
        try:
            while not self._stopping:
                if not core.has_work():
                    if governor is not None:
                        governor.reset()
                    core.wakeup.wait(0.5)
                    core.wakeup.clear()
                    continue
                self._step_started_at = time.monotonic()
                try:
                    deliveries = core.step()
                except Exception as exc:  # a bug outside the model: fail what is in flight, keep going
                    log.exception("engine loop error")
                    deliveries = self._fail_all(exc)
                self._step_started_at = None
                if governor is not None:
                    governor.after_step()
                if deliveries:
                    self._loop.call_soon_threadsafe(self._deliver, deliveries)
        except BaseException as exc:
            log.critical("the engine loop died", exc_info=exc)
            self.failure = f"the engine loop died ({type(exc).__name__}: {exc})"
            raise

    async def _watch(self) -> None:
        """The watchdog: a loop thread that died or a step past `stall_after_s` fails every request in
        flight with UnhealthyError at once (new ones are refused by `submit` while it lasts)."""
        failed_for: str | None = None
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if self._stopping:
                return
            reason = self._unhealthy_reason()
            if reason is not None and reason != failed_for:
                if reason == getattr(self.runner, "failure", None):  # logged where it arose (one line)
                    log.error("engine unhealthy; failing %d requests in flight", len(self._live))
                else:
                    log.error("engine unhealthy: %s; failing %d requests in flight", reason, len(self._live))
                self._fail_live(reason)
            failed_for = reason

    def _unhealthy_reason(self) -> str | None:
        if self.failure is not None:
            return self.failure
        if self._thread is None or not self._thread.is_alive():
            return "the engine loop is not running"
        shard_failure = getattr(self.runner, "failure", None)
        if shard_failure:  # a shard of the tensor-parallel group is gone
            return shard_failure
        started = self._step_started_at
        limit = self.stall_limit_s()
        if started is not None and time.monotonic() - started > limit:
            return (f"an engine step has run for {time.monotonic() - started:.0f} s "
                    f"(stalled: the limit is {limit:g} s)")
        return None

    def stall_limit_s(self) -> float:
        """How long the running step may take: `stall_after_s`, plus `stall_per_token_s` for each token
        it computes (the scheduler's count for the step; the last step's until this one is scheduled)."""
        return self.stall_after_s + self.stall_per_token_s * self.core.step_tokens

    def _fail_live(self, reason: str) -> None:
        """Fails every request in flight (on the event loop) and tells the loop thread to drop them."""
        for request_id, handle in list(self._live.items()):
            handle._deliver([], None, UnhealthyError(reason))
            self.core.abort(request_id)
        self._live.clear()

    def _fail_all(self, exc: Exception) -> list[Delivery]:
        deliveries = []
        for state in list(self.core.requests.values()):
            self.core._release(state)
            deliveries.append(Delivery(state, error=GenerationError(f"engine error: {exc}")))
        self.core.requests.clear()
        return deliveries

    def _deliver(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            handle = d.state.handle
            handle._deliver(d.events, d.result, d.error)
            if d.result is not None or d.error is not None:
                self._live.pop(d.state.request_id, None)
                self._probes.discard(d.state.request_id)

    def _cancel(self, request_id: str) -> None:
        self._probes.discard(request_id)
        handle = self._live.pop(request_id, None)
        if handle is not None:
            state = self.core.requests.get(request_id)
            if state is not None:  # what it used counts (tenant quotas): a count at most one step old
                handle.num_generated_tokens = sum(s.num_generated_tokens for s in state.seqs)
            self.core.abort(request_id)

    # --- requests ----------------------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`. With `max_tokens`, a text too long to fit is refused before it is
        tokenized (InputTooLongError): no token covers more characters than the vocabulary's longest."""
        if max_tokens is not None:
            self.check_text_length(text, max_tokens)
        return await asyncio.to_thread(
            lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def encode_images(self, text: str, images: list[ImageData], add_special_tokens: bool = True,
                            max_tokens: int | None = None) -> tuple[list[int], list[ImageInput]]:
        """Token ids of `text`, whose image markers (the chat template's) are expanded into each
        image's tokens, and the images preprocessed for the model, in order."""
        if not self.info.image_input:
            raise ValidationError("images are not supported: this model takes text only")
        if max_tokens is not None:
            self.check_text_length(text, max_tokens)
        try:
            return await asyncio.to_thread(self.loaded.image_prompts, text, images, add_special_tokens)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None

    def check_text_length(self, text: str, max_tokens: int) -> None:
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_chars = max((len(token) for token in vocab), default=0) or 1 << 30
        at_least = -(-len(text) // self._max_token_chars)
        if at_least > max_tokens:
            raise InputTooLongError(
                f"the input has at least {at_least} tokens ({len(text)} characters), more than the limit of "
                f"{max_tokens} tokens", input_tokens=at_least, max_new_tokens=None, limit=max_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def tokenize(self, text: str) -> TokenizedText | None:
        """Ids with character offsets; None when the tokenizer is not a fast one (no offsets)."""
        return await asyncio.to_thread(TokenizedText.of, self.tokenizer, text)

    async def encode_fim(self, prefix: str, suffix: str, fim_template: str | None = None) -> list[int]:
        from opentgi.engine.fim import build_fim_prompt_ids

        return await asyncio.to_thread(build_fim_prompt_ids, self.tokenizer, prefix, suffix, fim_template)

    def chat_template(self) -> ChatTemplate:
        named = getattr(self.tokenizer, "chat_template", None)
        tokens = getattr(self.tokenizer, "special_tokens_map", None) or {}
        return ChatTemplate(named if isinstance(named, dict) else self.info.chat_template,
                            bos_token=self.info.bos_token, eos_token=self.info.eos_token,
                            special_tokens={k: v for k, v in tokens.items() if isinstance(v, str)})

    def check_request(self, request: GenerationRequest) -> None:
        """The checks `submit` makes before queueing (limits that can never be met)."""
        info = self.info
        n_prompt = request.num_prompt_tokens
        if n_prompt == 0:
            raise ValidationError("the prompt must contain at least one token")
        ids = request.prompt_token_ids
        if min(ids) < 0 or max(ids) >= self.spec.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.spec.vocab_size)
            raise ValidationError(f"token id {bad} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        if request.n < 1:
            raise ValidationError(f"n must be at least 1, got {request.n}")
        if request.images and not info.image_input:
            raise ValidationError("images are not supported: this model takes text only")
        self.resolve_adapter(request)
        if request.score and not info.is_reward_model:
            raise NotSupportedError("scoring needs a reward model (a *ForSequenceClassification model)")
        if not request.score and info.is_reward_model:
            raise NotSupportedError("this is a reward model: it scores prompts and does not generate")
        if request.stopping.max_new_tokens < 1 and not request.score:
            raise ValidationError("max_new_tokens must be at least 1")
        max_new = None if request.score else request.stopping.max_new_tokens
        if request.score:
            needed = n_prompt
            if n_prompt > info.max_total_tokens:
                raise InputTooLongError(
                    f"the input has {n_prompt} tokens; the limit is {info.max_total_tokens}",
                    input_tokens=n_prompt, max_new_tokens=None, limit=info.max_total_tokens)
        else:
            if n_prompt >= info.max_total_tokens:
                raise InputTooLongError(
                    f"the input has {n_prompt} tokens, which leaves no room to generate within the "
                    f"{info.max_total_tokens}-token context (max_total_tokens)",
                    input_tokens=n_prompt, max_new_tokens=max_new, limit=info.max_total_tokens)
            needed = min(n_prompt + request.stopping.max_new_tokens, info.max_total_tokens)
        if needed > info.max_batch_total_tokens:
            raise InputTooLongError(
                f"the input ({n_prompt} tokens) and the tokens to generate need {needed} tokens of KV "
                f"cache, more than the whole pool holds ({info.max_batch_total_tokens} tokens, "
                f"max_batch_total_tokens)", input_tokens=n_prompt, max_new_tokens=max_new,
                limit=info.max_batch_total_tokens)
        if not self.scheduler.config.chunked_prefill and n_prompt > info.max_batch_prefill_tokens:
            raise InputTooLongError(
                f"the input has {n_prompt} tokens, more than one prefill step takes "
                f"({info.max_batch_prefill_tokens}, max_batch_prefill_tokens) with chunked prefill off",
                input_tokens=n_prompt, max_new_tokens=max_new, limit=info.max_batch_prefill_tokens)

    def resolve_adapter(self, request: GenerationRequest) -> None:
        """The base model's own id selects the base model (adapter_id None); any other id must name
        a loaded LoRA adapter."""
        adapter = request.adapter_id
        if adapter is None:
            return
        if adapter == self.info.model_id:
            request.adapter_id = None
        elif adapter not in self.info.adapters:
            raise UnknownAdapterError(adapter, self.info.adapters)

    async def submit(self, request: GenerationRequest, *, probe: bool = False) -> RequestHandle:
        """Queues `request`. A health probe (`probe=True`) is not counted against
        --max-concurrent-requests: a full server is still a healthy one."""
        if self._thread is None or self._loop is None:
            raise UnhealthyError("the engine is not started")
        reason = self._unhealthy_reason()
        if reason is not None:
            raise UnhealthyError(reason)
        if not probe and len(self._live) - len(self._probes) + self._compiling >= self.settings.max_concurrent_requests:
            raise OverloadedError("Model is overloaded")
        self.check_request(request)
        grammar_factory = None
        if request.grammar is not None:  # a request compiling its grammar holds a slot too
            self._compiling += 1
            try:
                grammar_factory = await self._compile_grammar(request)
            finally:
                self._compiling -= 1
            self.resolve_adapter(request)  # its adapter may have been unloaded meanwhile
        handle = RequestHandle(request, self._cancel)
        seqs = self._make_sequences(request, grammar_factory)
        state = RequestState(request, seqs, handle, queued_at=time.monotonic())
        self._live[request.request_id] = handle
        if probe:
            self._probes.add(request.request_id)
        self.core.add(state)
        return handle

    async def _compile_grammar(self, request: GenerationRequest):
        if self.settings.disable_grammar_support:
            raise NotSupportedError("Grammar and tools are not supported with this model")
        if self._grammar_compiler is None:
            from opentgi.engine.sampling.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.spec.vocab_size,
                                                     eos_token_ids=self.info.eos_token_ids)
        return await self._grammar_compiler.compile(request.grammar, timeout_s=self.grammar_compile_timeout_s)

    def _make_sequences(self, request: GenerationRequest, grammar_factory) -> list[Sequence]:
        sampling = request.sampling
        seqs: list[Sequence] = []
        for i in range(request.n):
            seed = None
            if sampling.do_sample:
                seed = sampling.seed + i if sampling.seed is not None else self._rng.getrandbits(63)
            processors = []
            if _needs_trigger(request):
                from opentgi.engine.sampling.grammar_trigger import TriggeredGrammar

                processors.append(TriggeredGrammar(grammar_factory, request.grammar, request.reasoning,
                                                   self.info.eos_token_ids))
            elif grammar_factory is not None:
                processors.append(grammar_factory())
            if sampling.watermark:
                from opentgi.engine.sampling.watermark import make_watermark_processor

                processors.append(make_watermark_processor(
                    self.spec.vocab_size, self.settings.watermark_gamma, self.settings.watermark_delta,
                    request.prompt_token_ids[-1]))
            seqs.append(Sequence(
                request, i, seed=seed,
                detokenizer=IncrementalDetokenizer(self._loop_tokenizer, request.prompt_token_ids),
                stop_checker=StopChecker(request.stopping, self.info.eos_token_ids, self.info.max_total_tokens),
                processors=processors, parent=seqs[0] if seqs else None))
        return seqs

    # --- LoRA adapters at run time (engine/adapter_loading.py) ------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        from opentgi.engine.adapter_loading import load_adapter

        await load_adapter(self, name, path)

    async def unload_adapter(self, name: str) -> None:
        from opentgi.engine.adapter_loading import unload_adapter

        await unload_adapter(self, name)

    # --- health and stats ----------------------------------------------------------------------------
    def healthy(self) -> bool:
        """The loop thread runs and no step has stalled (see the watchdog)."""
        return self._unhealthy_reason() is None

    async def probe(self, timeout_s: float = 60.0) -> bool:
        """One greedy one-token generation through the whole engine, outside the concurrency limit.
        A busy engine (sequences running, a step ended moments ago) is vouched for by its progress:
        the probe would only wait behind the queue."""
        if not self.healthy():
            return False
        if self.scheduler.running and time.monotonic() - self.core.last_step_at < BUSY_VOUCHES_S:
            return True
        token = (self.info.eos_token_ids or [0])[0]
        if self.info.is_reward_model:
            request = GenerationRequest([token], SamplingParams(), StoppingParams(max_new_tokens=1), score=True)
        else:
            request = GenerationRequest([token], SamplingParams(),
                                        StoppingParams(max_new_tokens=1, ignore_eos=True))
        try:
            handle = await self.submit(request, probe=True)
            await asyncio.wait_for(handle.result(), timeout_s)
            return True
        except Exception:
            log.exception("engine probe failed")
            return False

    def stats(self) -> EngineStats:
        bm = self.block_manager
        sched = self.scheduler
        running = list(sched.running)
        return EngineStats(
            waiting=sched.num_waiting, running=len(running), num_blocks=bm.num_blocks,
            used_blocks=bm.num_used_blocks, cached_blocks=bm.num_cached_blocks,
            tokens_held_running=sum(len(s) for s in running),
            peak_tokens_running=self.core.tokens_committed_running(),
            preemptions_total=sched.preemptions_total, prefix_hit_tokens=bm.prefix_hit_tokens,
            prefix_query_tokens=bm.prefix_query_tokens, steps_total=self.core.steps_total,
            last_step_at=self.core.last_step_at, requests_in_flight=len(self._live))
