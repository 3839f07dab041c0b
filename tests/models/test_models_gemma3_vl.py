"""Gemma 3 with images on the paged path against transformers' Gemma3ForConditionalGeneration, on
the tiny random model of tests/helpers/tiny_vision.py: pixels are Gemma3ImageProcessor's, the
prompt is expanded as Gemma3Processor documents it (its tokenizer class is Gemma's own, so the
expansion is written out here), and greedy tokens equal transformers' in float32 with logprobs
within 2e-3 for one image, two images and an image in the second turn, the image tokens attending
each other both ways as transformers masks them (`token_type_ids`). A request with images gets
the same tokens alone, batched, after a prefix-cache hit and in prefill chunks (which never end
inside an image)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from opentgi.config import Settings
from opentgi.models.loader import load_model
from tests.helpers.determinism import greedy
from tests.helpers.tiny_vision import png_bytes, tiny_gemma3_vl_path
from tests.helpers.vision_serving import among_others, data, greedy_answer, image_of, served

torch.set_num_threads(1)

WIDE, SQUARE = png_bytes(150, 100, seed=1), png_bytes(30, 30, seed=2)
PROMPTS = {
    "one image": ("<start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n", [WIDE]),
    "two images": ("<start_of_turn>user\n<start_of_image><start_of_image>Compare.<end_of_turn>\n"
                   "<start_of_turn>model\n", [WIDE, SQUARE]),
    "second turn": ("<start_of_turn>user\nHello.<end_of_turn>\n<start_of_turn>model\nHi.<end_of_turn>\n"
                    "<start_of_turn>user\nAnd this?<start_of_image><end_of_turn>\n<start_of_turn>model\n", [SQUARE]),
}


@pytest.fixture(scope="module")
def vlm():
    from transformers import Gemma3ForConditionalGeneration

    path = tiny_gemma3_vl_path()
    reference = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(Settings(model_id=str(path), dtype="float32")), reference


def transformers_greedy(loaded, reference, text, images, new_tokens, token_types=True):
    from transformers import Gemma3ImageProcessor

    pixels = Gemma3ImageProcessor.from_pretrained(tiny_gemma3_vl_path())(
        [image_of(raw) for raw in images], return_tensors="pt")["pixel_values"]
    expanded = text.replace("<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n")
    ids = loaded.tokenizer(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
    soft = loaded.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    extra = {"token_type_ids": (ids == soft).long()} if token_types else {}
    with torch.no_grad():
        out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                 max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, **extra)
    tokens, logprobs = greedy_answer(out, ids.shape[1])
    return ids[0].tolist(), pixels, tokens, logprobs


@pytest.mark.parametrize("case", PROMPTS)
def test_greedy_tokens_and_logprobs_match_transformers(vlm, case):
    loaded, reference = vlm
    text, images = PROMPTS[case]
    want_ids, pixels, want_tokens, want_logprobs = transformers_greedy(loaded, reference, text, images, 6)
    request, tokens, logprobs = asyncio.run(served(loaded, text, images, 6))
    assert request.prompt_token_ids == want_ids
    assert torch.equal(torch.cat([i.pixel_values for i in request.images]), pixels)
    assert list(tokens) == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 2e-3


def test_the_image_tokens_attend_each_other_both_ways(vlm):
    """Without transformers' token types (causal image tokens) its logprobs differ from ours."""
    loaded, reference = vlm
    text, images = PROMPTS["second turn"]
    *_, causal = transformers_greedy(loaded, reference, text, images, 6, token_types=False)
    *_, logprobs = asyncio.run(served(loaded, text, images, 6))
    assert max(abs(a - b) for a, b in zip(logprobs, causal)) > 0.1


def test_a_request_with_images_is_the_same_alone_batched_cached_and_chunked(vlm):
    loaded = vlm[0]
    text, images = PROMPTS["two images"]

    def run(others: int, warm: bool, **settings):
        return asyncio.run(among_others(loaded, text, images, lambda i: f"{'x ' * i}<start_of_image>Hi",
                                        (WIDE, SQUARE), others, warm, **settings))

    alone, _ = run(0, False)
    assert run(3, False)[0] == alone
    cached, hits = run(0, True)
    assert cached == alone and hits > 16
    assert run(2, False, chunked_prefill_tokens=7)[0] == alone


def test_chunks_never_end_inside_an_image(vlm):
    from types import SimpleNamespace

    from opentgi.engine.scheduling.scheduler import whole_images

    loaded = vlm[0]
    text, images = PROMPTS["one image"]
    ids, inputs = loaded.image_prompts(text, [data(raw) for raw in images], False)
    request = greedy(ids, 1)
    request.images = inputs
    seq = SimpleNamespace(request=request, num_computed_tokens=0)
    start, end = inputs[0].start, inputs[0].end
    assert whole_images(seq, start + 1) == start  # would end inside: ends before it
    assert whole_images(seq, end) == end and whole_images(seq, start) == start
    seq.num_computed_tokens = start  # the image starts the chunk: the chunk takes all of it
    assert whole_images(seq, 1) == end - start
