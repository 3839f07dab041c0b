"""SenseNova's own Python SDK (`sensenova`) against the live server: completions, streams, errors.

The SDK signs a JWT from its access keys and sends it as a bearer token; the live server runs
without --api-key, so any keys do.
"""

from __future__ import annotations

import pytest
import sensenova

KEYS = {"access_key_id": "test-ak", "secret_access_key": "test-sk"}


@pytest.fixture(scope="module")
def api_base(live_server) -> str:
    return f"{live_server}/v1"


def test_completion(api_base):
    answer = sensenova.Completion.create(api_base=api_base, model="tiny", prompt="Hello", max_new_tokens=3, n=4,
                                         **KEYS)
    choices = answer["data"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)
    usage = answer["data"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_stream(api_base):
    chunks = list(sensenova.Completion.create(api_base=api_base, model="tiny", prompt="Hello", max_new_tokens=3,
                                              stream=True, **KEYS))
    assert len(chunks) == 3  # the SDK stops at data:[DONE]
    assert all(c["status"]["code"] == 0 for c in chunks)
    assert chunks[-1]["data"]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["data"]["usage"]["completion_tokens"] == 3


def test_invalid_request_raises_the_sdks_typed_error(api_base):
    with pytest.raises(sensenova.error.InvalidRequestError) as raised:
        sensenova.Completion.create(api_base=api_base, model="tiny", prompt="Hello", n=9, **KEYS)
    assert raised.value.http_status == 400
    assert "n: 9 is greater than the maximum of 4" in str(raised.value)
