"""Images in the engine, on the tiny Idefics3 (tests/helpers/tiny_vision.py): the prefix cache keys
image tokens by the image's content hash (the same image and prompt hit it, another image of the
same size at the same place does not), image tokens are prompt tokens in every limit, and a
request with an image gets the same tokens and logprobs alone, batched with others (images too),
after a prefix-cache hit and with its image split across prefill chunks."""

from __future__ import annotations

import asyncio
import hashlib
import io

import pytest
import torch

from opentgi.config import Settings
from opentgi.engine.errors import InputTooLongError
from opentgi.engine.request import ImageData
from opentgi.models.loader import load_model
from tests.helpers.determinism import greedy, outcome
from tests.helpers.engine import generate, running
from tests.helpers.tiny_vision import png_bytes, tiny_idefics3_path

torch.set_num_threads(1)

TEXT = "User: Look.<image>What is this?<end_of_utterance>\nAssistant:"
FIRST, SECOND = png_bytes(90, 40, seed=1), png_bytes(90, 40, seed=7)  # same size: the same token ids


@pytest.fixture(scope="module")
def loaded():
    return load_model(Settings(model_id=str(tiny_idefics3_path()), dtype="float32"))


def image(raw: bytes) -> ImageData:
    from PIL import Image

    return ImageData(Image.open(io.BytesIO(raw)).convert("RGB"), hashlib.sha256(raw).hexdigest())


async def request_for(engine, raw: bytes, new_tokens: int = 5, text: str = TEXT):
    ids, inputs = await engine.encode_images(text, [image(raw)], add_special_tokens=False)
    request = greedy(ids, new_tokens)
    request.images = inputs
    return request


def test_the_prefix_cache_keys_image_tokens_by_content(loaded):
    async def main():
        async with running(loaded) as engine:
            first = await request_for(engine, FIRST)
            alone = outcome((await generate(engine, first)).sequences[0])
            start = first.images[0].start
            hits = engine.stats().prefix_hit_tokens
            again = outcome((await generate(engine, await request_for(engine, FIRST))).sequences[0])
            hit_same = engine.stats().prefix_hit_tokens - hits
            other = await request_for(engine, SECOND)
            assert other.prompt_token_ids == first.prompt_token_ids
            hits = engine.stats().prefix_hit_tokens
            await generate(engine, other)
            hit_other = engine.stats().prefix_hit_tokens - hits
            return alone, again, hit_same, hit_other, start, first.num_prompt_tokens, engine.block_manager.block_size

    alone, again, hit_same, hit_other, start, n_prompt, block = asyncio.run(main())
    assert again == alone  # a cache hit changes nothing
    assert hit_same == (n_prompt - 1) // block * block  # every full block of the prompt, images included
    assert hit_other == start // block * block  # only the blocks before the image


def test_an_image_request_is_the_same_alone_batched_cached_and_chunked(loaded):
    async def run(others: int, warm: bool, **settings):
        async with running(loaded, **settings) as engine:
            if warm:
                await generate(engine, await request_for(engine, FIRST, 1))
            requests = [await request_for(engine, SECOND if i % 2 else FIRST, 3 + i,
                                          text=f"User: {'x ' * i}<image>Hi<end_of_utterance>\nAssistant:")
                        for i in range(others)]
            requests += [greedy(list(range(500 + 10 * i, 510 + 10 * i)), 4) for i in range(others)]
            target = await request_for(engine, FIRST)
            handles = [await engine.submit(r) for r in [*requests[:others], target, *requests[others:]]]
            results = await asyncio.gather(*(h.result() for h in handles))
        return outcome(results[others].sequences[0])

    alone = asyncio.run(run(0, False))
    assert asyncio.run(run(3, False)) == alone
    assert asyncio.run(run(0, True)) == alone
    assert asyncio.run(run(2, False, chunked_prefill_tokens=7)) == alone


def test_image_tokens_count_in_the_prompt_limits(loaded):
    """The prompt below is 53 tokens, 12 of them the image's (two tiles and the global image, 4
    each): it leaves no room in a 50-token context, which its 41 others alone would."""
    async def main():
        async with running(loaded, max_total_tokens=50) as engine:
            request = await request_for(engine, FIRST)
            with pytest.raises(InputTooLongError, match="53 tokens"):
                await engine.submit(request)
            return request

    request = asyncio.run(main())
    assert len(request.images[0].positions) == 3 * 4
    assert request.num_prompt_tokens == 53


def test_without_batch_invariance_a_steps_images_are_encoded_as_one_batch(loaded, monkeypatch):
    from opentgi.engine.execution.model_runner import ModelRunner
    from opentgi.models.vision.processing import image_prompts_for

    prompts = image_prompts_for(tiny_idefics3_path(), loaded.hf_config.vision_source, loaded.tokenizer)
    _, inputs = prompts("<image><image><image>", [image(FIRST), image(SECOND), image(png_bytes(30, 30))], False)
    runner = ModelRunner(loaded.model, num_blocks=2, block_size=16)
    assert loaded.model.batch_invariant  # the default: each image alone
    runner.encode_images(inputs)
    alone = [i.embeds for i in inputs]
    calls = []
    encode = runner.vision.encode
    monkeypatch.setattr(runner.vision, "encode", lambda *a: calls.append(a[0].shape[0]) or encode(*a))
    monkeypatch.setattr(loaded.model, "batch_invariant", False)
    for i in inputs:
        i.embeds = None
    runner.encode_images(inputs)
    assert calls == [3 + 3 + 5]  # every tile of the three images, one call
    for one, batched in zip(alone, (i.embeds for i in inputs)):
        assert one.shape == batched.shape and torch.allclose(one, batched, atol=1e-5)
