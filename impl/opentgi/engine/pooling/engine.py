"""The engine of a pooling model (embedding, rerank, classification): no KV cache, no scheduler.

Requests queue their inputs; one thread (the only one running torch on several threads, as the
generation engine's loop: engine/execution/torch_threads.py) takes every input waiting, runs them
as one batch (`PoolingModel.run`: inputs of one length in one forward pass) and hands each request
its rows. It implements the API's `EngineClient` (text, health, stats, info); `submit` (generation)
is refused with `ModelKindError`, which every dialect answers in its own shape.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from opentgi.config import Settings
from opentgi.engine.errors import AdapterError, OverloadedError, UnhealthyError
from opentgi.engine.execution import torch_threads
from opentgi.engine.info import ChatTemplate, EngineInfo, EngineStats, TokenizedText
from opentgi.engine.pooling import kinds
from opentgi.engine.pooling.inputs import PoolingTokenizer
from opentgi.models.pooling.model import PoolingInput, PoolingModel

log = logging.getLogger(__name__)

PIPELINE_TAGS = {"embedding": "feature-extraction", "rerank": "text-ranking",
                 "classification": "text-classification"}


@dataclass
class _Job:
    inputs: list[PoolingInput]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    normalize: bool = False
    dimensions: int | None = None
    all_tokens: bool = False  # each input's token vectors, not pooled (TEI's /embed_all)
    queued_at: float = field(default_factory=time.monotonic)


class PoolingEngine:
    def __init__(self, model: PoolingModel, tokenizer, settings: Settings, *, model_id: str,
                 model_sha: str | None = None, observer=None):
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.observer = observer
        vocab_size = int(getattr(model.model.config, "vocab_size", 0) or len(tokenizer))
        self.inputs = PoolingTokenizer(tokenizer, model.max_length, vocab_size)
        param = next(model.model.parameters())
        self.info = EngineInfo(
            model_id=model_id, model_sha=model_sha, model_dtype=str(param.dtype),
            model_device_type=model.device.type, architecture=model.folder.architecture,
            pipeline_tag=PIPELINE_TAGS[model.kind], max_input_tokens=model.max_length,
            max_total_tokens=model.max_length, max_batch_total_tokens=model.max_batch_tokens,
            max_batch_prefill_tokens=model.max_batch_tokens, block_size=0, num_blocks=0,
            max_concurrent_requests=settings.max_concurrent_requests, runner_kind="pooling",
            vocab_size=vocab_size, deterministic=not settings.nondeterministic,
            model_kind=model.kind, embedding_dimension=model.hidden_size if model.kind == "embedding" else 0,
            bos_token=getattr(tokenizer, "bos_token", None), eos_token=getattr(tokenizer, "eos_token", None))
        self.id2label = dict(model.folder.id2label)
        self.normalizes = model.folder.normalize  # the folder has a Normalize module
        self._jobs: deque[_Job] = deque()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._in_flight = 0
        self._steps = 0
        self._last_step_at = 0.0
        self.failure: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, folder, observer=None) -> PoolingEngine:
        """Load the model of `folder` (a `PoolingFolder`) in a thread of its own
        (engine/execution/torch_threads.py)."""
        from opentgi.models.pooling.loading import load_pooling

        def build() -> PoolingEngine:
            model, tokenizer, model_id, model_sha = load_pooling(settings, folder)
            return cls(model, tokenizer, settings, model_id=model_id, model_sha=model_sha, observer=observer)

        return torch_threads.call_in_own_thread(build, settings.num_threads)

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="opentgi-pooling", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        while self._jobs:
            job = self._jobs.popleft()
            job.loop.call_soon_threadsafe(_fail, job.future, UnhealthyError("the engine stopped"))

    # --- the pooling requests ------------------------------------------------------------------
    def check_kind(self, asked: str) -> None:
        kinds.check(self.info.model_id, self.info.model_kind, asked)

    async def embed(self, inputs: list[PoolingInput], *, normalize: bool,
                    dimensions: int | None = None) -> list[list[float]]:
        """Each input's vector (its first `dimensions` components), normalized to unit length with
        `normalize`."""
        self.check_kind("embedding")
        return await self._queue(_Job(inputs, None, None, normalize=normalize, dimensions=dimensions))

    async def embed_all(self, inputs: list[PoolingInput]) -> list[list[list[float]]]:
        """Each input's token vectors (the model's last hidden states), not pooled nor normalized."""
        self.check_kind("embedding")
        return await self._queue(_Job(inputs, None, None, all_tokens=True))

    async def classify(self, inputs: list[PoolingInput]) -> list[list[float]]:
        """Each input's logits (one per label)."""
        self.check_kind("classification")
        return await self._queue(_Job(inputs, None, None))

    async def text_inputs(self, texts: list, *, truncate: bool, left: bool = False) -> list[PoolingInput]:
        """Texts (str) and token lists (list[int]) as model inputs, tokenized off the event loop."""
        def convert() -> list[PoolingInput]:
            return [self.inputs.ids(t, truncate=truncate, left=left) if isinstance(t, list)
                    else self.inputs.text(t, truncate=truncate, left=left) for t in texts]

        return await asyncio.to_thread(convert)

    async def pair_inputs(self, pairs: list[tuple[str, ...]], *, truncate: bool,
                          left: bool = False) -> list[PoolingInput]:
        """(text,) and (first, second) pairs as model inputs."""
        def convert() -> list[PoolingInput]:
            return [self.inputs.pair(p[0], p[1], truncate=truncate, left=left) if len(p) == 2
                    else self.inputs.text(p[0], truncate=truncate, left=left) for p in pairs]

        return await asyncio.to_thread(convert)

    async def _queue(self, job: _Job) -> list[list[float]]:
        if self.failure is not None or self._thread is None:
            raise UnhealthyError(self.failure or "the engine is not running")
        if self._in_flight >= self.settings.max_concurrent_requests:
            raise OverloadedError("Model is overloaded")
        job.loop = asyncio.get_running_loop()
        job.future = job.loop.create_future()
        self._in_flight += 1
        try:
            self._jobs.append(job)
            self._wakeup.set()
            return await job.future
        finally:
            self._in_flight -= 1

    def _run(self) -> None:
        torch_threads.apply(self.settings.num_threads)
        while not self._stopping:
            if not self._jobs:
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            jobs = []
            while self._jobs:
                jobs.append(self._jobs.popleft())
            jobs = [j for j in jobs if not j.future.cancelled()]
            for all_tokens in sorted({job.all_tokens for job in jobs}):  # pooled rows, token rows
                self._run_jobs([job for job in jobs if job.all_tokens == all_tokens], all_tokens)

    def _run_jobs(self, jobs: list[_Job], all_tokens: bool) -> None:
        try:
            rows = self.model.run([item for job in jobs for item in job.inputs], all_tokens=all_tokens)
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving
            log.exception("pooling forward pass failed")
            for job in jobs:
                job.loop.call_soon_threadsafe(_fail, job.future, UnhealthyError(f"inference failed: {exc}"))
            return
        self._steps += 1
        self._last_step_at = time.monotonic()
        start = 0
        for job in jobs:
            mine = rows[start:start + len(job.inputs)]
            start += len(job.inputs)
            result = [row.tolist() if all_tokens else _finish(row, job) for row in mine]
            job.loop.call_soon_threadsafe(_resolve, job.future, result)

    # --- EngineClient ------------------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        return await asyncio.to_thread(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def tokenize(self, text: str) -> TokenizedText | None:
        """Ids with character offsets; None when the tokenizer is not a fast one (no offsets)."""
        return await asyncio.to_thread(TokenizedText.of, self.tokenizer, text)

    async def encode_fim(self, prefix: str, suffix: str, fim_template: str | None = None) -> list[int]:
        raise kinds.refusal(self.info.model_id, self.info.model_kind, "generation")

    def chat_template(self) -> ChatTemplate:
        """Every chat route asks for the template first: refused here, before any rendering."""
        raise kinds.refusal(self.info.model_id, self.info.model_kind, "generation")

    async def submit(self, request):
        raise kinds.refusal(self.info.model_id, self.info.model_kind, "generation")

    async def load_adapter(self, name: str, path: str) -> None:
        raise AdapterError(f"LoRA adapters are served with generation models; {self.info.model_id!r} is "
                           f"{kinds.SERVES[self.info.model_kind]}")

    async def unload_adapter(self, name: str) -> None:
        raise AdapterError(f"an adapter named {name!r} is not loaded")

    def healthy(self) -> bool:
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    async def probe(self) -> bool:
        return self.healthy()

    def stats(self) -> EngineStats:
        return EngineStats(waiting=len(self._jobs), running=0, num_blocks=0, used_blocks=0, cached_blocks=0,
                           tokens_held_running=0, peak_tokens_running=0, preemptions_total=0,
                           prefix_hit_tokens=0, prefix_query_tokens=0, steps_total=self._steps,
                           last_step_at=self._last_step_at, requests_in_flight=self._in_flight)


def _finish(row: torch.Tensor, job: _Job) -> list[float]:
    if job.dimensions is not None:
        row = row[:job.dimensions]
    if job.normalize:
        row = row / row.norm().clamp_min(1e-12)
    return row.tolist()


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
