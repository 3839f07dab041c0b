"""A tiny random Idefics3 (SmolVLM's layout) with its processor, built in seconds and cached, and
small images made in memory.

- `tiny_idefics3_path()`: Idefics3ForConditionalGeneration saved as the hub has it
  (`save_pretrained` of the model and of an Idefics3Processor): a two-layer SigLIP tower of 56 x 56
  tiles in 14 x 14 patches, pixel shuffle by 2 (4 image tokens a tile), SmolLM2's tokenizer with
  the processor's image tokens added, SmolVLM's chat template, images split into tiles of 56 with
  the longest edge resized to 112 (at most 2 x 2 tiles and the global image).
- `png_bytes(width, height, seed)` / `jpeg_bytes(...)`: an image of random pixels, encoded.
- `reference_vision_position_ids()`: a context in which transformers' Idefics3 computes its vision
  position ids as fixed upstream (transformers 4.55-4.57 put them one off in float32).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from tests.helpers.tiny_models import EOS_TOKEN_IDS, _cached_folder, load_smollm2_tokenizer

SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TILE = 56


def tiny_idefics3_path(seed: int = 0) -> Path:
    params = {"seed": seed, "tile": TILE,
              "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                       "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "initializer_range": 0.1,
                       "tie_word_embeddings": False},
              "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "image_size": TILE, "patch_size": 14,
                         "initializer_range": 0.1}}

    def build(out: Path) -> None:
        import torch
        from transformers import (
            GenerationConfig,
            Idefics3Config,
            Idefics3ForConditionalGeneration,
            Idefics3ImageProcessor,
            Idefics3Processor,
        )

        tokenizer = load_smollm2_tokenizer()
        image_processor = Idefics3ImageProcessor(size={"longest_edge": 2 * params["tile"]},
                                                 max_image_size={"longest_edge": params["tile"]})
        processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                      chat_template=SMOLVLM_TEMPLATE)
        tokenizer.chat_template = SMOLVLM_TEMPLATE
        vocab_size = len(tokenizer)
        config = Idefics3Config(
            text_config={**params["text"], "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2},
            vision_config=params["vision"], scale_factor=2,
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
            torch_dtype="float32")
        torch.manual_seed(params["seed"])
        model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
        GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_IDS, pad_token_id=2).save_pretrained(out)

    return _cached_folder("tiny-idefics3", params, build)


def png_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def jpeg_bytes(width: int, height: int, seed: int = 0) -> bytes:
    return png_bytes(width, height, seed, fmt="JPEG")


@contextlib.contextmanager
def reference_vision_position_ids():
    """transformers' Idefics3VisionEmbeddings with the position ids of the fixed upstream code (and
    vLLM): fractional coordinates from arange(0, 1 - 1e-6, 1 / n)."""
    import torch
    from transformers.models.idefics3 import modeling_idefics3 as m

    def forward(self, pixel_values, patch_attention_mask):
        batch_size, _, max_h, max_w = pixel_values.shape
        embeddings = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        side = self.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        position_ids = torch.zeros(batch_size, (max_h // self.patch_size) * (max_w // self.patch_size),
                                   dtype=torch.long)
        for b, mask in enumerate(patch_attention_mask):
            nb_h, nb_w = int(mask[:, 0].sum()), int(mask[0].sum())
            h = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / nb_h), boundaries, right=True)
            w = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / nb_w), boundaries, right=True)
            position_ids[b][mask.view(-1)] = (h[:, None] * side + w).flatten()
        return embeddings + self.position_embedding(position_ids)

    original = m.Idefics3VisionEmbeddings.forward
    m.Idefics3VisionEmbeddings.forward = forward
    try:
        yield
    finally:
        m.Idefics3VisionEmbeddings.forward = original
