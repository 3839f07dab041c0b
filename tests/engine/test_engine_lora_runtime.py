"""LoRA adapters loaded and unloaded while the engine serves (engine/adapter_loading.py), on the tiny
Llama: a loaded adapter answers exactly as the same adapter given at start, unloading waits for no
one (409 while in use), and a bad adapter is refused by name while the engine keeps serving."""

from __future__ import annotations

import pytest

from opentgi.config import Settings
from opentgi.engine.errors import AdapterError, AdapterInUseError, UnknownAdapterError
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.loader import load_model
from tests.helpers import tiny_models
from tests.helpers.engine import generate, running


@pytest.fixture(scope="module")
def adapter(tiny_llama):
    return tiny_models.tiny_lora_path(tiny_llama, seed=1, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])


def greedy(adapter_id: str | None, max_new_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest([1, 5, 9, 13, 17], SamplingParams(), StoppingParams(max_new_tokens=max_new_tokens,
                                                                                   ignore_eos=True),
                             adapter_id=adapter_id)


async def test_load_use_unload(tiny_llama, adapter, tmp_path):
    at_start = load_model(Settings(model_id=str(tiny_llama), lora_adapters=f"a={adapter}"))
    async with running(at_start) as engine:
        expected = (await generate(engine, greedy("a"))).sequences[0].token_ids
    plain = load_model(Settings(model_id=str(tiny_llama)))
    async with running(plain) as engine:
        base = (await generate(engine, greedy(None))).sequences[0].token_ids
        assert base != expected  # the adapter visibly changes the answer
        with pytest.raises(AdapterError, match="'b'.*adapter_config.json"):  # not a PEFT folder
            await engine.load_adapter("b", str(tmp_path))
        await engine.load_adapter("a", str(adapter))
        assert engine.info.adapters == ["a"]
        assert (await generate(engine, greedy("a"))).sequences[0].token_ids == expected
        assert (await generate(engine, greedy(None))).sequences[0].token_ids == base
        with pytest.raises(AdapterError, match="already loaded"):
            await engine.load_adapter("a", str(adapter))
        long = await engine.submit(greedy("a", max_new_tokens=60))
        with pytest.raises(AdapterInUseError):
            await engine.unload_adapter("a")
        assert (await long.result()).sequences[0].token_ids[:8] == expected
        await engine.unload_adapter("a")
        assert engine.info.adapters == []
        with pytest.raises(UnknownAdapterError):
            await engine.submit(greedy("a"))
        assert (await generate(engine, greedy(None))).sequences[0].token_ids == base
