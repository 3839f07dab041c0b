"""Quality of the served weights: perplexity of the default model (SmolLM2-135M-Instruct) on a fixed
text, from the engine's own prompt logprobs (TGI's decoder_input_details). `--quantize int8`
(every layer projection int8 per channel) stays within 1% of the same weights in bfloat16."""

from __future__ import annotations

import math

import pytest

from opentgi.config import Settings
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.loader import load_model
from tests.engine_helpers import generate, running

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
    "goldsmith from Mainz, combined movable metal type, oil-based ink and a wooden press adapted "
    "from those used to make wine. Before his invention, books were copied by hand, which made them "
    "rare and expensive. Within a few decades, printing shops had opened in more than two hundred "
    "cities across Europe, and millions of books had been produced. The spread of printed material "
    "changed how people learned, argued and worshipped. Scholars could compare identical copies of "
    "a text, scientists could share their observations quickly, and ordinary people gained access "
    "to pamphlets, calendars and news. Historians often describe the printing press as one of the "
    "most important inventions of the second millennium, because it made knowledge cheaper, more "
    "reliable and far easier to spread than ever before."
)


async def served_perplexity(loaded) -> float:
    ids = loaded.tokenizer(TEXT)["input_ids"]
    request = GenerationRequest(ids, SamplingParams(), StoppingParams(max_new_tokens=1), prompt_logprobs=True)
    async with running(loaded) as engine:
        result = await generate(engine, request)
    logprobs = [token.logprob for token in result.prefill[1:]]
    assert len(logprobs) == len(ids) - 1 > 150
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.slow
async def test_int8_perplexity_is_within_one_percent_of_bfloat16(tmp_path):
    settings = dict(dtype="bfloat16", cache_dir=str(tmp_path))
    int4 = await served_perplexity(load_model(Settings(**settings)))  # the file's own Q4_1, int4 kernel
    int8 = await served_perplexity(load_model(Settings(quantize="int8", **settings)))
    bfloat16 = await served_perplexity(load_model(Settings(dequantize=True, **settings)))  # all dense
    print(f"perplexity: bfloat16 {bfloat16:.3f}, int8 {int8:.3f}, the GGUF's int4 {int4:.3f}")
    assert abs(int8 / bfloat16 - 1) < 0.01
    assert abs(int4 / bfloat16 - 1) < 0.01  # Q4_1's values, bfloat16 scales: the same weights
    assert 1 < bfloat16 < 30  # an instruct model on plain English prose
