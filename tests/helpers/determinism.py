"""Batch-invariance checks shared by the determinism tests: a greedy request's (tokens, logprobs) alone
and among others, on an engine over a loaded model."""

from __future__ import annotations

import asyncio

from opentgi.config import Settings
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.loader import load_model
from tests.helpers.engine import generate, running

NEW_TOKENS = 6


_LOADED: dict = {}


def loaded_model(model_path, dtype: str, **settings):
    key = (dtype, tuple(sorted(settings.items())))
    if key not in _LOADED:
        _LOADED[key] = load_model(Settings(model_id=str(model_path), dtype=dtype, **settings))
    return _LOADED[key]


def greedy(ids, max_new=NEW_TOKENS) -> GenerationRequest:
    return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=max_new, ignore_eos=True))


def outcome(sequence) -> tuple[list[int], list[float]]:
    return list(sequence.token_ids), [t.logprob for t in sequence.tokens]


async def run_target(loaded, target, others=(), position=0, warmup=None, stagger=False, **engine_settings):
    """The target's (tokens, logprobs), submitted at `position` among `others` (prompt, max_new)
    after an optional warm-up request (prefix-cache hits); with `stagger`, the later half of the
    others comes once the first half is running."""
    async with running(loaded, **engine_settings) as engine:
        if warmup is not None:
            await generate(engine, greedy(warmup, 1))
        requests = [greedy(p, n) for p, n in others]
        requests.insert(position, greedy(target))
        handles = []
        for i, request in enumerate(requests):
            if stagger and i == len(requests) // 2:
                await asyncio.sleep(0.05)
            handles.append(await engine.submit(request))
        results = await asyncio.gather(*(h.result() for h in handles))
    return outcome(results[position].sequences[0])


_ALONE: dict = {}


def alone(loaded, target):
    key = (id(loaded), tuple(target))
    if key not in _ALONE:
        _ALONE[key] = asyncio.run(run_target(loaded, target))
    return _ALONE[key]


TARGET = [1, 9690, 198, 2683, 314, 253, 5356, 6641, 28, 45, 2, 198, 1, 4093, 198] + list(range(400, 437))


OTHERS = [(list(range(1000 + 50 * i, 1000 + 50 * i + 3 + 5 * i)), 3 + i % 5) for i in range(16)]
