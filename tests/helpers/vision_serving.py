"""Serving an image request on a tiny vision-language model, and reading transformers' greedy
answer, as the VLM families' tests (tests/models/test_models_*_vl.py, llava_next) compare them."""

from __future__ import annotations

import asyncio
import hashlib
import io

import torch

from opentgi.engine.request import ImageData
from tests.helpers.determinism import greedy, outcome
from tests.helpers.engine import generate, running


def image_of(raw: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(raw)).convert("RGB")


def data(raw: bytes) -> ImageData:
    return ImageData(image_of(raw), hashlib.sha256(raw).hexdigest())


async def request_for(engine, text, images, new_tokens):
    ids, inputs = await engine.encode_images(text, [data(raw) for raw in images], add_special_tokens=False)
    request = greedy(ids, new_tokens)
    request.images = inputs
    return request


async def served(loaded, text, images, new_tokens):
    """(the request, its greedy tokens, their logprobs) from an engine on `loaded`."""
    async with running(loaded) as engine:
        request = await request_for(engine, text, images, new_tokens)
        sequence = (await generate(engine, request)).sequences[0]
    return request, sequence.token_ids, [t.logprob for t in sequence.tokens]


def greedy_answer(out, prompt_len: int) -> tuple[list[int], list[float]]:
    """The new tokens and their logprobs from transformers' `generate(..., output_scores=True,
    return_dict_in_generate=True)`."""
    tokens = out.sequences[0, prompt_len:].tolist()
    return tokens, [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]


async def among_others(loaded, text, images, other_text, other_images, others: int, warm: bool, **settings):
    """The greedy outcome of the request (text, images) served among `others` image requests
    (`other_text(i)` with `other_images[i % 2]`) and as many text-only ones, after one run of it
    first where `warm`; and the engine's prefix-cache hit tokens."""
    async with running(loaded, **settings) as engine:
        if warm:
            await generate(engine, await request_for(engine, text, images, 1))
        requests = [await request_for(engine, other_text(i), [other_images[i % 2]], 3 + i) for i in range(others)]
        requests += [greedy(list(range(500 + 10 * i, 510 + 10 * i)), 4) for i in range(others)]
        target = await request_for(engine, text, images, 5)
        handles = [await engine.submit(r) for r in [*requests[:others], target, *requests[others:]]]
        results = await asyncio.gather(*(h.result() for h in handles))
        return outcome(results[others].sequences[0]), engine.stats().prefix_hit_tokens
