"""Helpers shared by the engine tests: an engine running over a loaded model, and one request's
result."""

from __future__ import annotations

import contextlib

from opentgi.config import Settings
from opentgi.engine.engine import Engine


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
