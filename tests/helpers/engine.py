"""Helpers shared by the engine tests: an engine running over a loaded model, and one request's
result."""

from __future__ import annotations

import contextlib

from opentgi.config import Settings
from opentgi.engine.engine import Engine
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.sequence import Sequence


@contextlib.asynccontextmanager
async def running(loaded, observer=None, **settings):
    settings.setdefault("max_batch_total_tokens", 4096)  # a small pool: tests need no more
    engine = Engine(loaded, Settings(**settings), observer=observer)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


APP_MAX_INPUT, APP_MAX_TOTAL = 40, 64  # the limits of the engine under conftest's `client`


async def generate(engine, request):
    return await (await engine.submit(request)).result()


def make_seq(tokens: list[int]) -> Sequence:
    req = GenerationRequest(list(tokens), SamplingParams(), StoppingParams(max_new_tokens=8))
    return Sequence(req, 0, seed=None, detokenizer=None, stop_checker=StopChecker(req.stopping, [], 1 << 20),
                    processors=[])
