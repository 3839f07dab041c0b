"""A tiny random Idefics3 (SmolVLM's layout) with its processor, built in seconds and cached, and
small images made in memory.

- `tiny_idefics3_path()`: Idefics3ForConditionalGeneration saved as the hub has it
  (`save_pretrained` of the model and of an Idefics3Processor): a two-layer SigLIP tower of 56 x 56
  tiles in 14 x 14 patches, pixel shuffle by 2 (4 image tokens a tile), SmolLM2's tokenizer with
  the processor's image tokens added, SmolVLM's chat template, images split into tiles of 56 with
  the longest edge resized to 112 (at most 2 x 2 tiles and the global image).
- `tiny_qwen2_5_vl_path()`: Qwen2_5_VLForConditionalGeneration, as the hub has it (see there).
- `tiny_gemma3_vl_path()`: Gemma3ForConditionalGeneration with its image processor (see there).
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


QWEN2_5_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_5_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_qwen2_5_vl_path(seed: int = 0) -> Path:
    """A tiny random Qwen2_5_VLForConditionalGeneration saved as the hub has it (`save_pretrained`
    of the model, the image processor's preprocessor_config.json, the tokenizer and
    chat_template.jinja): a three-block vision tower (hidden 32, 2 heads) of 14 x 14 patches with
    windows of 2 x 2 merged patches (56 pixels) and full attention in block 1, images resized to
    between 56 x 56 and 112 x 112 pixels; a two-layer Qwen2 text model with M-RoPE sections
    [2, 3, 3]; SmolLM2's tokenizer with Qwen's vision tokens added."""
    params = {"seed": seed,
              "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                       "rms_norm_eps": 1e-6, "rope_theta": 100000.0, "initializer_range": 0.1,
                       "tie_word_embeddings": False,
                       "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
              "vision": {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                         "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                         "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
                         "tokens_per_second": 2, "hidden_act": "silu", "initializer_range": 0.1},
              "pixels": {"min_pixels": 56 * 56, "max_pixels": 112 * 112}}

    def build(out: Path) -> None:
        import json

        import torch
        from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        tokenizer = load_smollm2_tokenizer()
        tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_5_VL_TOKENS})
        tokenizer.chat_template = QWEN2_5_VL_TEMPLATE
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_5_VL_TOKENS}
        config = Qwen2_5_VLConfig(
            text_config={**params["text"], "vocab_size": len(tokenizer), "bos_token_id": 1, "eos_token_id": 2},
            vision_config=params["vision"], image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, torch_dtype="float32")
        torch.manual_seed(params["seed"])
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        (out / "chat_template.jinja").write_text(QWEN2_5_VL_TEMPLATE)
        # Qwen2VLImageProcessor's saved config (the video processor beside it needs torchvision)
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
            "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2, **params["pixels"],
            "size": {"shortest_edge": params["pixels"]["min_pixels"],
                     "longest_edge": params["pixels"]["max_pixels"]}}, indent=2))
        GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_IDS, pad_token_id=2).save_pretrained(out)

    return _cached_folder("tiny-qwen2_5_vl", params, build)


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def tiny_gemma3_vl_path(seed: int = 0) -> Path:
    """A tiny random Gemma3ForConditionalGeneration with its image processor, saved as the hub
    has it (`save_pretrained` of the model and the Gemma3ImageProcessor, processor_config.json,
    the tokenizer and chat_template.jinja): the gemma3 family's tiny text config (sliding windows
    of 8, local RoPE base), a two-layer SigLIP tower over 56 x 56 images in 14 x 14 patches, pooled
    2 x 2 into 4 image tokens; SmolLM2's tokenizer with Gemma 3's image tokens added."""
    from tests.helpers.tiny_models import FAMILY_CONFIGS

    params = {"seed": seed, "text": {**FAMILY_CONFIGS["gemma3"][2], "final_logit_softcapping": None},
              "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
              "tokens": 4}

    def build(out: Path) -> None:
        import json

        import torch
        from transformers import (
            Gemma3Config,
            Gemma3ForConditionalGeneration,
            Gemma3ImageProcessor,
            GenerationConfig,
        )

        tokenizer = load_smollm2_tokenizer()
        tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
        tokenizer.chat_template = GEMMA3_TEMPLATE
        boi, eoi, soft = (tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_TOKENS)
        config = Gemma3Config(
            text_config={**params["text"], "vocab_size": len(tokenizer), "bos_token_id": 1, "eos_token_id": 2},
            vision_config=params["vision"], mm_tokens_per_image=params["tokens"], boi_token_index=boi,
            eoi_token_index=eoi, image_token_index=soft, torch_dtype="float32")
        torch.manual_seed(params["seed"])
        model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
        with torch.no_grad():  # zeros at initialisation: random, so that a wrong projection shows
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        (out / "chat_template.jinja").write_text(GEMMA3_TEMPLATE)
        Gemma3ImageProcessor(size={"height": 56, "width": 56}).save_pretrained(out)
        (out / "processor_config.json").write_text(json.dumps({"image_seq_length": params["tokens"],
                                                                "processor_class": "Gemma3Processor"}))
        GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_IDS, pad_token_id=2).save_pretrained(out)

    return _cached_folder("tiny-gemma3-vl", params, build)


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


LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST] {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} [/INST]{% else %}<|im_end|>{% endif %}{% endfor %}"
)


def tiny_llava_next_path(text: str = "llama", seed: int = 0) -> Path:
    """A tiny random LlavaNextForConditionalGeneration saved as the hub has it (`save_pretrained` of
    the model and of a LlavaNextProcessor): a three-layer CLIP tower over 56 x 56 tiles in 14 x 14
    patches (16 features a tile, its class token dropped: `default`), features of layer -2
    (`text="mistral"`: layers [-3, -1] concatenated, and a sliding window of 48 in the text model),
    any-resolution tiling among 56 x 112, 112 x 56, 112 x 112, 168 x 56 and 56 x 168, a two-layer
    Llama (or Mistral) text model; SmolLM2's tokenizer with `<image>` added."""
    params = {"seed": seed, "text_type": text,
              "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                       "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "initializer_range": 0.1,
                       "tie_word_embeddings": False, **({"sliding_window": 48} if text == "mistral" else {})},
              "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                         "num_attention_heads": 2, "image_size": 56, "patch_size": 14, "projection_dim": 32,
                         "hidden_act": "quick_gelu", "initializer_range": 0.1},
              "layer": [-3, -1] if text == "mistral" else -2,
              "pinpoints": [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]}

    def build(out: Path) -> None:
        import torch
        from transformers import (
            GenerationConfig,
            LlavaNextConfig,
            LlavaNextForConditionalGeneration,
            LlavaNextImageProcessor,
            LlavaNextProcessor,
        )

        tokenizer = load_smollm2_tokenizer()
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
        tokenizer.chat_template = LLAVA_NEXT_TEMPLATE
        image_processor = LlavaNextImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
                                                  image_grid_pinpoints=params["pinpoints"])
        processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                       vision_feature_select_strategy="default", chat_template=LLAVA_NEXT_TEMPLATE,
                                       num_additional_image_tokens=1)  # CLIP's class token
        config = LlavaNextConfig(
            text_config={**params["text"], "model_type": text, "vocab_size": len(tokenizer), "bos_token_id": 1,
                         "eos_token_id": 2},
            vision_config={**params["vision"], "model_type": "clip_vision_model"},
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=params["layer"],
            vision_feature_select_strategy="default", image_grid_pinpoints=params["pinpoints"],
            tie_word_embeddings=False, torch_dtype="float32")
        torch.manual_seed(params["seed"])
        model = LlavaNextForConditionalGeneration(config).to(torch.float32).eval()
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
        GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_IDS, pad_token_id=2).save_pretrained(out)

    return _cached_folder("tiny-llava-next", params, build)
