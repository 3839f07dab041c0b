"""Qwen2.5-VL on the paged path against transformers' Qwen2_5_VLForConditionalGeneration, on the
tiny random model of tests/helpers/tiny_vision.py: each image's pixels are transformers' slow
Qwen2VLImageProcessor's (the processor itself wants torchvision for its video half, so the prompt
is expanded here as it documents: one `<|image_pad|>` per merged patch), greedy tokens equal
transformers' in float32 with logprobs within 2e-3 for one image, two images and an image in the
second turn (M-RoPE positions, and the decode positions after the images), and a request with
images gets the same tokens alone, batched, after a prefix-cache hit and in prefill chunks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from opentgi.config import Settings
from opentgi.models.loader import load_model
from tests.helpers.tiny_vision import png_bytes, tiny_qwen2_5_vl_path
from tests.helpers.vision_serving import among_others, data, greedy_answer, image_of, served

torch.set_num_threads(1)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
WIDE, SQUARE = png_bytes(150, 100, seed=1), png_bytes(30, 30, seed=2)  # 12 and 4 image tokens
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
PROMPTS = {
    "one image": (f"{SYSTEM}<|im_start|>user\n{IMAGE}What is this?<|im_end|>\n<|im_start|>assistant\n", [WIDE]),
    "two images": (f"{SYSTEM}<|im_start|>user\n{IMAGE}{IMAGE}Compare.<|im_end|>\n<|im_start|>assistant\n",
                   [WIDE, SQUARE]),
    "second turn": (f"{SYSTEM}<|im_start|>user\nHello.<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n"
                    f"<|im_start|>user\nAnd this?{IMAGE}<|im_end|>\n<|im_start|>assistant\n", [SQUARE]),
}


@pytest.fixture(scope="module")
def vlm():
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = tiny_qwen2_5_vl_path()
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(Settings(model_id=str(path), dtype="float32")), reference


def transformers_pixels(images):
    """(pixel_values, image_grid_thw) from transformers' own slow image processor."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor.from_pretrained(tiny_qwen2_5_vl_path())
    out = processor(images=[image_of(raw) for raw in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def transformers_greedy(loaded, reference, text, images, new_tokens):
    pixels, grids = transformers_pixels(images)
    for grid in grids:  # the processor's expansion: one pad per merged patch
        text = text.replace(IMAGE, IMAGE.replace("<|image_pad|>", "<|image_pad_here|>" * (int(grid.prod()) // 4)), 1)
    ids = loaded.tokenizer(text.replace("<|image_pad_here|>", "<|image_pad|>"), add_special_tokens=False,
                           return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                 image_grid_thw=grids, max_new_tokens=new_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
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


def test_mrope_positions_are_transformers_rope_index(vlm):
    """Every prompt token's three positions and the decode delta, against get_rope_index, and
    for any chunk of the prompt (chunked prefill)."""
    loaded, reference = vlm
    text, images = PROMPTS["two images"]
    ids, inputs = loaded.image_prompts(text, [data(raw) for raw in images], False)
    grids = torch.tensor([i.grid for i in inputs])
    want, delta = reference.model.get_rope_index(torch.tensor([ids]), grids, None, attention_mask=None)
    vision = loaded.model.vision
    assert torch.equal(vision.mrope_positions(inputs, 0, len(ids)), want[:, 0])
    assert torch.equal(vision.mrope_positions(inputs, 7, 30), want[:, 0, 7:30])
    after = vision.mrope_positions(inputs, len(ids), len(ids) + 3)
    assert after.tolist() == [[len(ids) + int(delta) + k for k in range(3)]] * 3


def test_pixels_match_a_float64_reading_of_the_documented_algorithm():
    """Independent of transformers: smart_resize, bicubic resize, rescale and normalise in float64,
    patches as the processor lays them out (channel, frame, row, column inside each patch)."""
    import math

    from PIL import Image

    from opentgi.models.vision.qwen2_5_vl_processing import Qwen2VLImages

    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    images = Qwen2VLImages({"min_pixels": 56 * 56, "max_pixels": 112 * 112})
    for width, height in ((150, 100), (30, 30), (200, 40)):
        image = image_of(png_bytes(width, height, seed=width))
        pixels, grid = images(image)
        h, w = grid[1] * 14, grid[2] * 14
        assert h % 28 == 0 and w % 28 == 0 and 56 * 56 <= h * w <= 112 * 112
        assert abs(math.log(w / h) - math.log(width / height)) < 0.75
        x = (np.asarray(image.resize((w, h), Image.BICUBIC), dtype=np.float64) / 255 - mean) / std
        x = np.repeat(x.transpose(2, 0, 1)[None], 2, axis=0)  # [frame, c, h, w]
        rows = []
        for by in range(0, h // 14, 2):
            for bx in range(0, w // 14, 2):
                for dy in range(2):
                    for dx in range(2):
                        y0, x0 = (by + dy) * 14, (bx + dx) * 14
                        rows.append(x[:, :, y0:y0 + 14, x0:x0 + 14].transpose(1, 0, 2, 3).reshape(-1))
        assert np.abs(pixels.numpy() - np.stack(rows)).max() < 1e-5


def test_a_request_with_images_is_the_same_alone_batched_cached_and_chunked(vlm):
    loaded = vlm[0]
    text, images = PROMPTS["two images"]

    def run(others: int, warm: bool, **settings):
        return asyncio.run(among_others(loaded, text, images, lambda i: f"{'x ' * i}{IMAGE}Hi",
                                        (WIDE, SQUARE), others, warm, **settings))

    alone, _ = run(0, False)
    assert run(3, False)[0] == alone
    cached, hits = run(0, True)
    assert cached == alone and hits > 16  # the images' blocks came from the cache
    assert run(2, False, chunked_prefill_tokens=7)[0] == alone


def test_images_encoded_as_one_batch_give_each_image_its_rows(vlm):
    """--nondeterministic: the step's images in one pass of the tower (windows and full
    attention stay within each image); a refused image is named."""
    loaded = vlm[0]
    _, inputs = loaded.image_prompts(IMAGE * 3, [data(WIDE), data(SQUARE), data(png_bytes(60, 130, seed=4))], False)
    vision = loaded.model.vision
    vision.encode_images(inputs, batched=False)
    alone = [i.embeds for i in inputs]
    vision.encode_images(inputs, batched=True)
    for one, batched in zip(alone, (i.embeds for i in inputs)):
        assert one.shape == batched.shape and torch.allclose(one, batched, atol=1e-5)
    with pytest.raises(ValueError, match="image 1: .*aspect ratio is over 200"):
        loaded.image_prompts(IMAGE * 2, [data(WIDE), data(png_bytes(1000, 4))], False)


def test_the_newer_checkpoint_layout_loads_the_same_weights(vlm, tmp_path):
    """transformers' newer names (`model.visual.*`, `model.language_model.*`) load as the hub's do."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tiny_qwen2_5_vl_path()
    for item in path.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, tmp_path / item.name)
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
               for k, v in tensors.items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    newer = load_model(Settings(model_id=str(tmp_path), dtype="float32")).model
    older = vlm[0].model
    assert torch.equal(newer.vision.blocks[0].attn.qkv.weight, older.vision.blocks[0].attn.qkv.weight)
    assert torch.equal(newer.model.embed_tokens.weight, older.model.embed_tokens.weight)
    assert torch.equal(newer.vision.merger.mlp[2].weight, older.vision.merger.mlp[2].weight)
