"""Multimodal checkpoints read through their text tower: Gemma 3's 4B, 12B and 27B
(`Gemma3ForConditionalGeneration`; the 1B is the text-only `Gemma3ForCausalLM`), served with its
image encoder where the folder has its image processor, else on the text tower alone (without an
image a prompt never reaches the vision tower, so the text tower computes what the whole model
does; the APIs refuse its image inputs), and Idefics3 / SmolVLM
(`Idefics3ForConditionalGeneration`), Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) and
LLaVA-NeXT (`LlavaNextForConditionalGeneration`), whose image encoders are loaded beside it (`VISION_TOWERS`, models/vision/).

- `text_config`: the checkpoint's text config in place of the wrapper's, still naming the
  wrapper's architecture (what /info reports and the registry maps to a family), with the
  wrapper's forward's values where they differ (no final logit soft-capping).
  An image-taking checkpoint's text config also holds the whole one as `vision_source`.
- `tensor_renamer`: the text tower's tensor names as the decoder's (both layouts transformers
  has saved: `language_model.model.*` and `model.language_model.*`); the vision tower's and the
  projector's tensors are skipped (None), or for an image-taking checkpoint named as the paged
  model's `vision` module holds them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

# served with their image encoder (Gemma 3: where the folder has its image processor)
VISION_TOWERS = ("Idefics3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                 "Gemma3ForConditionalGeneration", "LlavaNextForConditionalGeneration")
TEXT_TOWERS = VISION_TOWERS
_GEMMA3_RENAMED = (("vision_tower.", "vision."), ("model.vision_tower.", "vision."),
                   ("multi_modal_projector.", "vision.projector."),
                   ("model.multi_modal_projector.", "vision.projector."))
_IDEFICS3_RENAMED = (("model.text_model.", "model."), ("model.vision_model.", "vision.vision_model."),
                     ("model.connector.", "vision.connector."))
# both layouts: transformers 4.x's save_pretrained writes the first names (the hub's), loads either
_QWEN2_5_VL_RENAMED = (("visual.", "vision."), ("model.visual.", "vision."), ("model.language_model.", "model."))
# both layouts: transformers 4.x's save_pretrained writes the unprefixed names (the hub's)
_LLAVA_NEXT_RENAMED = (("vision_tower.", "vision.tower."), ("model.vision_tower.", "vision.tower."),
                       ("multi_modal_projector.", "vision.projector."),
                       ("model.multi_modal_projector.", "vision.projector."),
                       ("image_newline", "vision.image_newline"), ("model.image_newline", "vision.image_newline"))
_RENAMED = (("language_model.model.", "model."), ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."))
_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _architecture(config) -> str | None:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else None


def is_text_tower(config) -> bool:
    return _architecture(config) in TEXT_TOWERS


def text_config(config, images: bool | None = None):
    """The text config of a TEXT_TOWERS checkpoint (its `architectures` the wrapper's), else
    `config` itself. `images`: served with its image encoder (default: all but Gemma 3)."""
    if not is_text_tower(config) or getattr(config, "text_config", None) is None:
        return config
    arch = _architecture(config)
    text = copy.deepcopy(config.text_config)
    text.architectures = [arch]
    if images if images is not None else arch != "Gemma3ForConditionalGeneration":
        text.vision_source = config
    if arch == "Gemma3ForConditionalGeneration":
        # transformers' Gemma3ForConditionalGeneration never soft-caps its logits (Gemma 3's own
        # checkpoints set no cap; only a text-only Gemma3ForCausalLM applies one it is given)
        text.final_logit_softcapping = None
    return text


def text_tower_name(name: str) -> str | None:
    for old, new in _RENAMED:
        if name.startswith(old):
            return new + name[len(old):]
    return None if name.startswith(_SKIPPED) else name


def idefics3_name(name: str) -> str:
    for old, new in _IDEFICS3_RENAMED:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def qwen2_5_vl_name(name: str) -> str:
    for old, new in _QWEN2_5_VL_RENAMED:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def llava_next_name(name: str) -> str | None:
    for old, new in _LLAVA_NEXT_RENAMED:
        if name.startswith(old):
            return new + name[len(old):]
    return text_tower_name(name)


def gemma3_name(name: str) -> str | None:
    for old, new in _GEMMA3_RENAMED:
        if name.startswith(old):
            renamed = new + name[len(old):]
            # SigLIP's pooling head (`vision_use_head`): Gemma 3 reads the patches, never the head
            return None if renamed.startswith("vision.vision_model.head.") else renamed
    return text_tower_name(name)


def tensor_renamer(config) -> Callable[[str], str | None] | None:
    """How the checkpoint's tensor names map to the paged decoder's (None: as they are)."""
    arch = _architecture(config)
    if arch == "Qwen2_5_VLForConditionalGeneration":
        return qwen2_5_vl_name
    if arch == "Gemma3ForConditionalGeneration":
        return gemma3_name if getattr(config, "vision_source", None) is not None else text_tower_name
    if arch == "LlavaNextForConditionalGeneration":
        return llava_next_name
    if arch in VISION_TOWERS:
        return idefics3_name
    return text_tower_name if is_text_tower(config) else None
