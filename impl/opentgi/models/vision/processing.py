"""A prompt with images -> its token ids and one preprocessed `ImageInput` per image
(Qwen2.5-VL's: qwen2_5_vl_processing.py; Gemma 3's: `Gemma3Prompts`; LLaVA-NeXT's: `LlavaNextPrompts`).

Idefics3 (SmolVLM): transformers' own Idefics3ImageProcessor, read from the model folder, preprocesses
each image (resize, split into tiles, rescale, normalise: its pixels by construction), and its
`get_image_prompt_string` expands the prompt's `<image>` marker into the image's tokens (a row and
column tag, `<fake_token_around_image>` and `image_seq_len` `<image>` tokens per tile, the global
image last), as Idefics3Processor's `__call__` does; the expanded text is tokenized whole. Each
image is preprocessed on its own, so its pixels never depend on the other images of the request.
"""

from __future__ import annotations

import json
from pathlib import Path

from opentgi.models.vision.inputs import ImageData, ImageInput, split_at_markers, token_id


def slow_image_processor(folder: Path):
    """The folder's image processor, transformers' slow one (the fast one needs torchvision, which the
    pinned torch has not); ValueError where the folder has none that loads."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(folder, use_fast=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"the folder has no usable image processor ({exc})") from None


class Idefics3Prompts:
    # Idefics3Processor's own tokens (it takes none from its config)
    image_token, fake_token, global_token = "<image>", "<fake_token_around_image>", "<global-img>"

    def __init__(self, folder: Path, tokenizer):
        self.image_processor = slow_image_processor(folder)
        config = folder / "processor_config.json"
        # Idefics3Processor's default when its config does not say
        self.image_seq_len = int(json.loads(config.read_text()).get("image_seq_len", 169)) if config.is_file() else 169
        self.tokenizer = tokenizer
        self.image_token_id = token_id(tokenizer, self.image_token)
        self.chat_template = processor_chat_template(folder)

    def __call__(self, text: str, images: list[ImageData], add_special_tokens: bool) -> tuple[list[int], list[ImageInput]]:
        from transformers.models.idefics3.processing_idefics3 import get_image_prompt_string

        pieces = split_at_markers(text, self.image_token, len(images))
        expanded, tensors = [pieces[0]], []
        for image, after in zip(images, pieces[1:]):
            # a PIL image is height x width x channels: said, not guessed (transformers guesses
            # channels first for an image 1 or 3 pixels high, which scrambles it)
            out = self.image_processor([[image.image]], return_row_col_info=True, return_tensors="pt",
                                       input_data_format="channels_last")
            rows, cols = out["rows"][0][0], out["cols"][0][0]
            expanded.append(get_image_prompt_string(rows, cols, self.image_seq_len, self.fake_token,
                                                    self.image_token, self.global_token))
            expanded.append(after)
            tensors.append((out["pixel_values"][0], out["pixel_attention_mask"][0].bool()))
        ids = list(self.tokenizer("".join(expanded), add_special_tokens=add_special_tokens)["input_ids"])
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        wanted = sum(pixels.shape[0] for pixels, _ in tensors) * self.image_seq_len
        if len(positions) != wanted:
            raise ValueError(f"the prompt holds {len(positions)} image tokens where its images give {wanted}")
        inputs, at = [], 0
        for image, (pixels, mask) in zip(images, tensors):
            mine = positions[at:at + pixels.shape[0] * self.image_seq_len]
            at += len(mine)
            inputs.append(ImageInput(content_hash=image.sha256, start=mine[0], end=mine[-1] + 1, positions=mine,
                                     pixel_values=pixels, pixel_mask=mask))
        return ids, inputs


class Gemma3Prompts:
    """Gemma 3: transformers' Gemma3ImageProcessor (slow) resizes each image to the tower's square and
    normalises it; each `<start_of_image>` of the prompt (the chat template's image) becomes
    Gemma3Processor's "\\n\\n<start_of_image>", `image_seq_length` `<image_soft_token>`s and
    "<end_of_image>\\n\\n". Pan and scan (extra crops) is not taken."""

    image_token, soft_token, end_token = "<start_of_image>", "<image_soft_token>", "<end_of_image>"

    def __init__(self, folder: Path, tokenizer, config):
        self.image_processor = slow_image_processor(folder)
        if getattr(self.image_processor, "do_pan_and_scan", False):
            raise ValueError("the image processor's do_pan_and_scan is not supported")
        processor = folder / "processor_config.json"
        saved = json.loads(processor.read_text()) if processor.is_file() else {}
        self.image_seq_len = int(saved.get("image_seq_length", config.mm_tokens_per_image))
        self.tokenizer = tokenizer
        for token in (self.image_token, self.end_token):
            token_id(tokenizer, token)  # ValueError where the tokenizer lacks one
        self.soft_token_id = token_id(tokenizer, self.soft_token)
        self.chat_template = processor_chat_template(folder)

    def __call__(self, text: str, images: list[ImageData], add_special_tokens: bool) -> tuple[list[int], list[ImageInput]]:
        pieces = split_at_markers(text, self.image_token, len(images))
        sequence = f"\n\n{self.image_token}{self.soft_token * self.image_seq_len}{self.end_token}\n\n"
        ids = list(self.tokenizer(sequence.join(pieces), add_special_tokens=add_special_tokens)["input_ids"])
        positions = [i for i, token in enumerate(ids) if token == self.soft_token_id]
        if len(positions) != len(images) * self.image_seq_len:
            raise ValueError(f"the prompt holds {len(positions)} {self.soft_token} tokens where its images "
                             f"give {len(images) * self.image_seq_len}")
        inputs = []
        for k, image in enumerate(images):
            out = self.image_processor([image.image], return_tensors="pt", input_data_format="channels_last",
                                       do_pan_and_scan=False)
            mine = positions[k * self.image_seq_len:(k + 1) * self.image_seq_len]
            if mine[-1] - mine[0] + 1 != len(mine):
                raise ValueError(f"an image's {self.soft_token} tokens are not together in the prompt")
            inputs.append(ImageInput(content_hash=image.sha256, start=mine[0], end=mine[-1] + 1, positions=mine,
                                     pixel_values=out["pixel_values"], bidirectional=True))
        return ids, inputs


class LlavaNextPrompts:
    """LLaVA-NeXT: transformers' LlavaNextImageProcessor (slow) gives each image's tiles (the base
    image, then its any-resolution grid); each `<image>` of the prompt becomes as many `<image>`
    tokens as the encoder gives it rows (`llava_next.image_tokens`), as LlavaNextProcessor
    expands it, and the expanded text is tokenized whole."""

    image_token = "<image>"

    def __init__(self, folder: Path, tokenizer, config):
        self.image_processor = slow_image_processor(folder)
        vision = config.vision_config
        crop = getattr(self.image_processor, "crop_size", None) or {}
        if crop.get("height", vision.image_size) != vision.image_size or crop.get("width", vision.image_size) != vision.image_size:
            raise ValueError(f"the image processor's crop_size {crop} is not the vision tower's {vision.image_size}")
        self.pinpoints = [list(p) for p in config.image_grid_pinpoints]
        self.tile, self.patch = vision.image_size, vision.patch_size
        self.tokenizer = tokenizer
        self.image_token_id = token_id(tokenizer, self.image_token)
        self.chat_template = processor_chat_template(folder)

    def __call__(self, text: str, images: list[ImageData], add_special_tokens: bool) -> tuple[list[int], list[ImageInput]]:
        from opentgi.models.vision.llava_next import image_tokens

        pieces = split_at_markers(text, self.image_token, len(images))
        expanded, tensors = [pieces[0]], []
        for image, after in zip(images, pieces[1:]):
            out = self.image_processor([image.image], return_tensors="pt", input_data_format="channels_last")
            size = (image.image.height, image.image.width)
            tokens = image_tokens(size, self.pinpoints, self.tile, self.patch)
            expanded.append(self.image_token * tokens)
            expanded.append(after)
            tensors.append((out["pixel_values"][0], size, tokens))
        ids = list(self.tokenizer("".join(expanded), add_special_tokens=add_special_tokens)["input_ids"])
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        wanted = sum(tokens for *_, tokens in tensors)
        if len(positions) != wanted:
            raise ValueError(f"the prompt holds {len(positions)} image tokens where its images give {wanted}")
        inputs, at = [], 0
        for image, (pixels, size, tokens) in zip(images, tensors):
            mine = positions[at:at + tokens]
            at += tokens
            inputs.append(ImageInput(content_hash=image.sha256, start=mine[0], end=mine[-1] + 1, positions=mine,
                                     pixel_values=pixels, size=size))
        return ids, inputs


def processor_chat_template(folder: Path) -> str | None:
    """The chat template transformers saved with the processor (`chat_template.jinja`, or the older
    `chat_template.json`), else None."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


def image_prompts_for(folder: Path, config, tokenizer):
    """The prompt builder of a vision-language checkpoint the paged path serves, else None."""
    archs = getattr(config, "architectures", None) or []
    if archs and archs[0] == "Idefics3ForConditionalGeneration":
        return Idefics3Prompts(folder, tokenizer)
    if archs and archs[0] == "Gemma3ForConditionalGeneration":
        # without its image processor the folder is served as its text tower (images refused)
        return Gemma3Prompts(folder, tokenizer, config) if (folder / "preprocessor_config.json").is_file() else None
    if archs and archs[0] == "Qwen2_5_VLForConditionalGeneration":
        from opentgi.models.vision.qwen2_5_vl_processing import Qwen2_5_VLPrompts

        return Qwen2_5_VLPrompts(folder, tokenizer, processor_chat_template(folder))
    if archs and archs[0] == "LlavaNextForConditionalGeneration":
        return LlavaNextPrompts(folder, tokenizer, config)
    return None
