"""LLaVA-NeXT on the paged path against transformers' LlavaNextForConditionalGeneration, on the tiny
random models of tests/helpers/tiny_vision.py: the prompt ids and pixels are transformers' own
LlavaNextProcessor's (slow image processor: the base image and the any-resolution tiles, each
`<image>` expanded to the unpadded features and a newline per row), greedy tokens equal
transformers' in float32 with logprobs within 2e-3 for one image, two images and an image in the
second turn, with a Llama text model (layer -2's features) and with a Mistral one (a sliding
window shorter than the prompt; layers -3 and -1 concatenated); a request with images gets the
same tokens alone, batched and after a prefix-cache hit; transformers' newer tensor names load the
same weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from opentgi.config import Settings
from opentgi.models.loader import load_model
from tests.helpers.tiny_vision import png_bytes, tiny_llava_next_path
from tests.helpers.vision_serving import among_others, greedy_answer, image_of, served

torch.set_num_threads(1)

# 150 x 100 (w x h): a 2 x 2 grid of tiles, unpadded top and bottom; 40 x 90: a 2 x 1 grid; 30 x 30:
# a 1 x 2 grid, unpadded at the sides
WIDE, TALL, SQUARE = png_bytes(150, 100, seed=1), png_bytes(40, 90, seed=2), png_bytes(30, 30, seed=3)
PROMPTS = {
    "one image": ("[INST] <image>\nWhat is this? [/INST]", [WIDE]),
    "two images": ("[INST] <image>\n<image>\nCompare. [/INST]", [TALL, SQUARE]),
    "second turn": ("[INST] Hello. [/INST]Hi.<|im_end|>[INST] And this?<image>\n [/INST]", [WIDE]),
}
CASES = [("llama", case) for case in PROMPTS] + [("mistral", "two images")]


_MODELS: dict = {}


def models(text: str):
    if text not in _MODELS:
        from transformers import LlavaNextForConditionalGeneration

        path = tiny_llava_next_path(text)
        reference = LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        _MODELS[text] = load_model(Settings(model_id=str(path), dtype="float32")), reference, path
    return _MODELS[text]


def transformers_greedy(reference, path, text, images, new_tokens):
    from transformers import LlavaNextProcessor

    processor = LlavaNextProcessor.from_pretrained(path, use_fast=False)
    inputs = processor(images=[image_of(raw) for raw in images], text=text, add_special_tokens=False,
                       return_tensors="pt")
    keep = ("input_ids", "attention_mask", "pixel_values", "image_sizes")
    with torch.no_grad():
        out = reference.generate(**{k: inputs[k] for k in keep}, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
    ids = inputs["input_ids"]
    tokens, logprobs = greedy_answer(out, ids.shape[1])
    return ids[0].tolist(), inputs["pixel_values"], tokens, logprobs


@pytest.mark.parametrize("text, case", CASES)
def test_greedy_tokens_and_logprobs_match_transformers(text, case):
    loaded, reference, path = models(text)
    prompt, images = PROMPTS[case]
    want_ids, pixels, want_tokens, want_logprobs = transformers_greedy(reference, path, prompt, images, 6)
    request, tokens, logprobs = asyncio.run(served(loaded, prompt, images, 6))
    assert request.prompt_token_ids == want_ids
    for image, want in zip(request.images, pixels):  # the processor pads a batch to its most tiles
        assert torch.equal(image.pixel_values, want[:image.pixel_values.shape[0]])
    assert list(tokens) == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 2e-3


def test_a_request_with_images_is_the_same_alone_batched_and_cached():
    loaded = models("llama")[0]
    prompt, images = PROMPTS["two images"]

    def run(others: int, warm: bool, **settings):
        return asyncio.run(among_others(loaded, prompt, images, lambda i: f"[INST] {'x ' * i}<image>\nHi [/INST]",
                                        (WIDE, SQUARE), others, warm, **settings))

    alone, _ = run(0, False)
    assert run(3, False)[0] == alone
    cached, hits = run(0, True)
    assert cached == alone and hits > 64


def test_the_newer_checkpoint_layout_loads_the_same_weights(tmp_path):
    """transformers' newer names (`model.vision_tower.*`, `model.multi_modal_projector.*`,
    `model.image_newline`, `model.language_model.*`, `lm_head.*`) load as the hub's do."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tiny_llava_next_path()
    for item in path.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, tmp_path / item.name)
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
               ("image_newline", "model.image_newline"))

    def newer(name: str) -> str:
        old, new = next((o, n) for o, n in renames if name.startswith(o))
        return new + name[len(old):]

    save_file({newer(k): v for k, v in load_file(str(path / "model.safetensors")).items()},
              str(tmp_path / "model.safetensors"))
    loaded, older = load_model(Settings(model_id=str(tmp_path), dtype="float32")).model, models("llama")[0].model
    for name in ("vision.tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
                 "vision.projector.linear_2.weight", "vision.image_newline", "model.embed_tokens.weight",
                 "model.norm.weight"):
        assert torch.equal(loaded.get_parameter(name), older.get_parameter(name)), name
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the head (packed at load, so compared by what it computes)
        assert torch.equal(loaded.compute_logits(hidden), older.compute_logits(hidden))
