"""Idefics3 (SmolVLM) on the paged path against transformers' Idefics3ForConditionalGeneration, on
the tiny random model of tests/helpers/tiny_vision.py: the prompt's tokens and each image's pixels
are the processor's, and greedy tokens equal transformers' in float32 with logprobs within 2e-3,
for one image, two images and an image in the second turn. transformers' vision position ids are
taken as fixed upstream (`reference_vision_position_ids`)."""

from __future__ import annotations

import asyncio
import hashlib
import io

import pytest
import torch

from opentgi.config import Settings
from opentgi.engine.request import ImageData
from opentgi.models.loader import load_model
from tests.helpers.determinism import greedy
from tests.helpers.engine import generate, running
from tests.helpers.tiny_vision import png_bytes, reference_vision_position_ids, tiny_idefics3_path

torch.set_num_threads(1)

WIDE, SQUARE = png_bytes(90, 40, seed=1), png_bytes(30, 30, seed=2)
PROMPTS = {
    "one image": ("User:<image>What is this?<end_of_utterance>\nAssistant:", [WIDE]),
    "two images": ("User:<image><image>Compare them.<end_of_utterance>\nAssistant:", [WIDE, SQUARE]),
    "second turn": ("User: Hello.<end_of_utterance>\nAssistant: Hi.<end_of_utterance>\n"
                    "User: And this?<image><end_of_utterance>\nAssistant:", [SQUARE]),
}


def image_of(raw: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(raw)).convert("RGB")


@pytest.fixture(scope="module")
def vlm():
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    path = tiny_idefics3_path()
    reference = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(Settings(model_id=str(path), dtype="float32")), AutoProcessor.from_pretrained(path), reference


def transformers_greedy(processor, reference, text, images, new_tokens):
    inputs = processor(text=text, images=[[image_of(raw) for raw in images]], add_special_tokens=False,
                       return_tensors="pt")
    inputs.pop("token_type_ids", None)
    with reference_vision_position_ids(), torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]
    return inputs, tokens, logprobs


async def served(loaded, text, images, new_tokens):
    async with running(loaded) as engine:
        data = [ImageData(image_of(raw), hashlib.sha256(raw).hexdigest()) for raw in images]
        ids, inputs = await engine.encode_images(text, data, add_special_tokens=False)
        request = greedy(ids, new_tokens)
        request.images = inputs
        sequence = (await generate(engine, request)).sequences[0]
    return ids, inputs, sequence.token_ids, [t.logprob for t in sequence.tokens]


@pytest.mark.parametrize("case", PROMPTS)
def test_greedy_tokens_and_logprobs_match_transformers(vlm, case):
    loaded, processor, reference = vlm
    text, images = PROMPTS[case]
    inputs, want_tokens, want_logprobs = transformers_greedy(processor, reference, text, images, 5)
    ids, image_inputs, tokens, logprobs = asyncio.run(served(loaded, text, images, 5))
    assert ids == inputs["input_ids"][0].tolist()
    # each image's pixels are the processor's (its tiles, in order; none padded here)
    assert torch.equal(torch.cat([i.pixel_values for i in image_inputs]), inputs["pixel_values"][0])
    assert list(tokens) == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 2e-3


def test_the_fixed_position_ids_differ_from_transformers_4_57(vlm):
    """The reference's fix matters: transformers' own float32 position ids are one bucket short."""
    loaded, processor, reference = vlm
    inputs = processor(text="<image>", images=[[image_of(WIDE)]], add_special_tokens=False, return_tensors="pt")
    pixels, mask = inputs["pixel_values"][0], inputs["pixel_attention_mask"][0].bool()
    ours = loaded.model.vision.encode(pixels, mask)
    with reference_vision_position_ids(), torch.no_grad():
        fixed = reference.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
    assert torch.allclose(ours, fixed.reshape(ours.shape), atol=1e-5)
    side = loaded.model.vision.vision_model.embeddings.side
    ids = loaded.model.vision.vision_model.embeddings.position_ids(torch.ones(1, side, side, dtype=torch.bool))
    assert ids[0].tolist() == list(range(side * side))


def test_thin_images_are_read_height_by_width(vlm):
    """A PIL image is height x width x channels; transformers would guess channels first for an
    image 1 or 3 pixels high. 1 x 1 and 2 x 2 both scale to 112 x 112: 2 x 2 tiles and the global."""
    loaded = vlm[0]
    for width, height in ((1, 1), (2, 2), (3000, 1)):
        data = ImageData(image_of(png_bytes(width, height)), "h")
        _, (image,) = loaded.image_prompts("<image>", [data], False)
        assert image.pixel_values.shape[0] == (3 if width > 2 else 5)
