"""Qwen2.5-VL's prompts with images -> token ids and one preprocessed `ImageInput` per image.

transformers' Qwen2_5_VLProcessor wants a video processor, which needs torchvision (whose CPU wheel
does not fit the pinned torch), so the image processor is built here, from the folder's
`preprocessor_config.json`, as Qwen2VLImageProcessor (the slow one) computes it: `smart_resize`
(each side a multiple of patch x merge, the area within [min_pixels, max_pixels], the aspect
kept), Pillow's bicubic resize of the 8-bit RGB image, rescale (in float64, then float32) and
normalize (float32), and the patches cut as the processor lays them out (the image repeated as
its second frame; merge x merge neighbouring patches together). The prompt's
`<|vision_start|><|image_pad|><|vision_end|>` (the chat template's image) gets one `<|image_pad|>`
per merged patch, as the processor expands it, and the expanded text is tokenized whole.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from opentgi.models.vision.inputs import ImageData, ImageInput, split_at_markers, token_id

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / STD, the processor's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's: the size nearest (height, width) with both sides multiples of `factor` and the
    area within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image {width} x {height} pixels: its aspect ratio is over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLImages:
    """Qwen2VLImageProcessor's preprocessing of one image, from its saved config."""

    def __init__(self, config: dict):
        size = config.get("size") or {}
        self.min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.patch_size = int(config.get("patch_size", 14))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        self.do_resize = bool(config.get("do_resize", True))
        self.resample = int(config.get("resample", 3))  # Pillow's BICUBIC
        self.do_rescale = bool(config.get("do_rescale", True))
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(config.get("do_normalize", True))
        self.mean = np.array(config.get("image_mean") or CLIP_MEAN, dtype=np.float32)
        self.std = np.array(config.get("image_std") or CLIP_STD, dtype=np.float32)

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """A PIL image -> (pixel_values [patches, 3 * frames * p * p] float32, grid (1, rows, columns))."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        width, height = image.size
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if self.do_resize:
            height, width = smart_resize(height, width, p * m, self.min_pixels, self.max_pixels)
            image = image.resize((width, height), resample=self.resample, reducing_gap=None)
        pixels = np.asarray(image)
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            pixels = (pixels.astype(np.float32) - self.mean) / self.std
        pixels = np.repeat(pixels.transpose(2, 0, 1)[None], tp, axis=0)  # [frames, C, H, W]
        grid_h, grid_w = height // p, width // p
        patches = pixels.reshape(1, tp, 3, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(grid_h * grid_w, 3 * tp * p * p)
        return torch.from_numpy(np.ascontiguousarray(patches, dtype=np.float32)), (1, grid_h, grid_w)


class Qwen2_5_VLPrompts:
    image_token = "<|vision_start|><|image_pad|><|vision_end|>"  # the chat template's image
    pad_token = "<|image_pad|>"

    def __init__(self, folder: Path, tokenizer, chat_template: str | None):
        config = folder / "preprocessor_config.json"
        if not config.is_file():
            raise ValueError("the folder has no preprocessor_config.json")
        self.images = Qwen2VLImages(json.loads(config.read_text()))
        self.tokenizer = tokenizer
        self.pad_token_id = token_id(tokenizer, self.pad_token)
        self.chat_template = chat_template  # the processor's (processing.py: processor_chat_template)

    def __call__(self, text: str, images: list[ImageData], add_special_tokens: bool) -> tuple[list[int], list[ImageInput]]:
        pieces = split_at_markers(text, self.image_token, len(images))
        expanded, tensors = [pieces[0]], []
        for index, (image, after) in enumerate(zip(images, pieces[1:])):
            try:
                pixels, grid = self.images(image.image)
            except ValueError as exc:
                raise ValueError(f"image {index}: {exc}") from None
            tokens = grid[0] * grid[1] * grid[2] // self.images.merge_size ** 2
            expanded.append(self.image_token.replace(self.pad_token, self.pad_token * tokens))
            expanded.append(after)
            tensors.append((pixels, grid, tokens))
        ids = list(self.tokenizer("".join(expanded), add_special_tokens=add_special_tokens)["input_ids"])
        positions = [i for i, token in enumerate(ids) if token == self.pad_token_id]
        wanted = sum(tokens for _, _, tokens in tensors)
        if len(positions) != wanted:
            raise ValueError(f"the prompt holds {len(positions)} {self.pad_token} tokens where its images give {wanted}")
        inputs, at = [], 0
        for image, (pixels, grid, tokens) in zip(images, tensors):
            mine = positions[at:at + tokens]
            at += tokens
            if mine[-1] - mine[0] + 1 != tokens:
                raise ValueError(f"an image's {self.pad_token} tokens are not together in the prompt")
            inputs.append(ImageInput(content_hash=image.sha256, start=mine[0], end=mine[-1] + 1, positions=mine,
                                     pixel_values=pixels, grid=grid))
        return ids, inputs
