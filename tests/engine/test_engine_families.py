"""The whole engine on families beside Llama: greedy output equals transformers' with chunked
prefill, with prefix-cache hits, and with --speculate (drafts verified in the same forward)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from opentgi.config import Settings
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models.loader import load_model
from tests.helpers import tiny_models
from tests.helpers.engine import generate, running

torch.set_num_threads(1)

TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(",  # shares a prefix
         "The quick brown fox jumps over the lazy dog. The quick brown fox"]
MAX_NEW = 20


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe", "phi3", "gemma3_multimodal"])
def test_greedy_through_the_engine_equals_transformers(family):
    """gemma3_multimodal: Gemma3ForConditionalGeneration, its text tower on the paged path."""
    multimodal = family == "gemma3_multimodal"
    path = tiny_models.tiny_gemma3_multimodal_path() if multimodal else tiny_models.tiny_family_path(family)
    loaded = load_model(Settings(model_id=str(path), dtype="float32", num_threads=1))
    assert loaded.kind == "paged"
    if multimodal:
        assert loaded.spec.architecture == "Gemma3ForConditionalGeneration"
    prompts = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=2)[0, len(p):].tolist() for p in prompts]

    def request(ids):
        return GenerationRequest(list(ids), SamplingParams(), StoppingParams(max_new_tokens=MAX_NEW))

    async def run(**settings):
        async with running(loaded, **settings) as engine:
            first = [await generate(engine, request(p)) for p in prompts]  # the 2nd hits the 1st's blocks
            batched = await asyncio.gather(*[generate(engine, request(p)) for p in prompts])
            hits = engine.scheduler.block_manager.prefix_hit_tokens
            return [r.sequences[0].token_ids for r in first + list(batched)], engine, hits

    plain, _, hits = asyncio.run(run(chunked_prefill_tokens=16))
    assert plain == want + want
    assert hits >= 16  # the shared prefix, and each prompt again in the batched round
    speculated, engine, _ = asyncio.run(run(chunked_prefill_tokens=16, speculate=4))
    assert speculated == want + want
    assert engine.scheduler.draft_tokens_total > 0  # verify rows ran (accepted or rejected)
