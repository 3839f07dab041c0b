"""The pooling engine (engine/pooling/): built for a pooling folder by `engine_from_settings`,
concurrent requests run in one forward pass, generation refused naming what the model serves."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from opentgi.config import Settings
from opentgi.engine.errors import AdapterError, ModelKindError, OverloadedError
from opentgi.engine.pooling import engine_from_settings
from opentgi.engine.pooling.engine import PoolingEngine
from opentgi.models.pooling.loading import pooling_folder_of
from tests.helpers import tiny_models, tiny_pooling


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    settings = Settings(model_id=str(tiny_pooling.tiny_bert_embedding_path()), device="cpu", num_threads=1,
                        max_concurrent_requests=4)
    return engine_from_settings(settings)


def test_the_folder_picks_the_engine(engine):
    assert isinstance(engine, PoolingEngine)
    assert (engine.info.model_kind, engine.info.embedding_dimension, engine.info.max_input_tokens) == ("embedding", 64, 64)
    assert pooling_folder_of(Settings(model_id=str(tiny_models.tiny_llama_path()))) is None
    assert pooling_folder_of(Settings()) is None  # the default model


def test_concurrent_requests_share_a_forward_pass(engine):
    calls: list[int] = []
    inside, release = threading.Event(), threading.Event()
    real_run = engine.model.run

    def run(inputs, all_tokens=False):
        calls.append(len(inputs))
        if len(calls) == 1:
            inside.set()
            release.wait(10)
        return real_run(inputs, all_tokens)

    async def scenario():
        await engine.start()
        try:
            texts = [["hello world"], ["the cat sat on the mat", "paris"], ["deep learning"], ["hello world"]]
            inputs = [await engine.text_inputs(t, truncate=False) for t in texts]
            first = asyncio.ensure_future(engine.embed(inputs[0], normalize=True))
            await asyncio.to_thread(inside.wait, 10)  # the thread runs the first request's pass
            rest = [asyncio.ensure_future(engine.embed(i, normalize=True)) for i in inputs[1:]]
            await asyncio.sleep(0.05)
            with pytest.raises(OverloadedError):  # four in flight: the fifth is refused
                await engine.embed(inputs[0], normalize=True)
            release.set()
            return await first, await asyncio.gather(*rest)
        finally:
            await engine.stop()

    engine.model.run = run
    try:
        first, rest = asyncio.run(scenario())
    finally:
        engine.model.run = real_run
    assert calls == [1, 4]  # the three requests that waited ran as one batch
    assert rest[2] == first  # the same text, alone and in a batch: the same bits


def test_generation_is_refused_naming_what_the_model_serves(engine):
    with pytest.raises(ModelKindError, match="is an embedding model: it serves /v1/embeddings, /embed, /embed_all and /similarity"):
        asyncio.run(engine.submit(None))
    with pytest.raises(ModelKindError, match="does not serve text generation"):
        engine.chat_template()
    with pytest.raises(ModelKindError, match="does not serve classification"):
        asyncio.run(engine.classify([]))
    with pytest.raises(AdapterError, match="served with generation models"):
        asyncio.run(engine.load_adapter("a", "/nowhere"))
