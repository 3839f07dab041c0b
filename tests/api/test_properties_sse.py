"""Property test of the one SSE helper (opentgi.api.sse): for random JSON payloads (text with
newlines, carriage returns, Unicode line and paragraph separators, any non-ASCII, lone surrogates,
numbers, nesting),
the stream `_frame` writes parses back, with httpx-sse (a standard SSE parser), into one event per
payload whose data is the same JSON; a failing source ends with one error event."""

from __future__ import annotations

import asyncio
import json

import httpx
from httpx_sse import EventSource
from hypothesis import given, settings
from hypothesis import strategies as st

from opentgi.api.sse import _frame, tgi_error_event
from opentgi.engine.errors import GenerationError
from tests.helpers.hypothesis_profiles import examples

texts = st.text(alphabet=st.one_of(st.characters(), st.sampled_from("\n\r\r\n\u2028\u2029\x85\x0b\x0c\x1c:")))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64),
                    st.floats(allow_nan=False, allow_infinity=False), texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
payloads = st.dictionaries(texts, json_values, max_size=5)


ERROR = GenerationError("generation failed:\nline two")


def frame(events: list, fail: bool = False) -> bytes:
    async def source():
        for event in events:
            yield event
        if fail:
            raise ERROR

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in _frame(source(), tgi_error_event, keep_alive_s=None)])

    return asyncio.run(collect())


def parse(body: bytes) -> list[str]:
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)
    return [sse.data for sse in EventSource(response).iter_sse()]


@settings(max_examples=examples(200))
@given(events=st.lists(payloads, min_size=1, max_size=4), fail=st.booleans())
def test_every_event_parses_back_to_its_json(events, fail):
    data = parse(frame(events, fail))
    assert len(data) == len(events) + fail
    assert [json.loads(d) for d in data[:len(events)]] == events
    if fail:
        assert json.loads(data[-1]) == tgi_error_event(ERROR)
