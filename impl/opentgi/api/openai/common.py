"""What the two OpenAI routes share: the `[DONE]` line, parsing a body into its generated model,
the limits in force, TGI's request metrics, submitting several engine requests and merging their
event streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pydantic

from opentgi.api.errors import tgi_error
from opentgi.api.generation import ErrorPolicy
from opentgi.api.openai.params import OpenAILimits
from opentgi.engine.errors import ValidationError
from opentgi.engine.events import TokenEvent

# sse.sse_event writes "data:" + a str event verbatim: the leading space gives "data: [DONE]".
DONE = " [DONE]"
# TGI's error shape; a stream that fails still ends with [DONE].
ERROR_POLICY = ErrorPolicy(error=tgi_error, stream_end_after_error=DONE)


def parse_model(model, body: dict):
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:  # the document and the generated model disagree
        first = exc.errors()[0]
        raise ValidationError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from exc


def limits_of(state) -> OpenAILimits:
    info = state.engine.info
    vocab = info.vocab_size
    return OpenAILimits.from_settings(state.settings, info, vocab)


async def cached_tokens(handles: list) -> int:
    """Prompt tokens the requests found in the prefix cache (their results are in once every
    sequence has finished)."""
    return sum([(await handle.result()).num_cached_tokens for handle in handles])


async def events_of(handles: list) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(handle index, event) from several handles as they come; cancels them all when closed."""
    if len(handles) == 1:
        try:
            async for event in handles[0]:
                yield 0, event
        finally:
            handles[0].cancel()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle) -> None:
        try:
            async for event in handle:
                queue.put_nowait((i, event, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                remaining -= 1
                continue
            yield i, event
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()


