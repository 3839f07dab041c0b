"""What a request carries of its images: `ImageData` from the API's intake, `ImageInput` once
preprocessed for the model (the engine's `GenerationRequest.images`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageData:
    """An image as the API's intake hands it to the engine: decoded (a PIL image) and validated,
    with the SHA-256 of its bytes."""

    image: Any
    sha256: str


@dataclass
class ImageInput:
    """One image of a prompt, preprocessed for the model (models/vision/processing.py). Its tokens
    are prompt tokens: they count in every token limit and budget like any other."""

    content_hash: str  # of the image's bytes: the prefix cache keys the blocks of its tokens by it
    start: int  # the prompt index of its first image token
    end: int  # one past its last image token
    positions: list[int]  # the prompt indices whose embeddings the image encoder gives, in order
    # Idefics3, LLaVA-NeXT: tensor [tiles, channels, height, width]; Qwen2.5-VL: [patches, channels * 2 * 14 * 14]
    pixel_values: Any
    pixel_mask: Any = None  # Idefics3: bool tensor [tiles, height, width]: real pixels (not padding)
    grid: tuple[int, int, int] | None = None  # Qwen2.5-VL: its patch grid (frames, rows, columns)
    size: tuple[int, int] | None = None  # LLaVA-NeXT: the image's (height, width) before preprocessing
    # Gemma 3: its tokens attend each other both ways (a prefill chunk never ends inside them)
    bidirectional: bool = False
    # the encoder's rows for `positions`, set by the model runner when first needed and kept for
    # the request's life (a preempted sequence recomputes its prompt without encoding again)
    embeds: Any = None


def token_id(tokenizer, token: str) -> int:
    """The id of a model's image token; ValueError where the tokenizer lacks it."""
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer has no {token} token")
    return found


def split_at_markers(text: str, marker: str, num_images: int) -> list[str]:
    """The prompt's text around its image markers, one marker per image (else ValueError)."""
    pieces = text.split(marker)
    if len(pieces) - 1 != num_images:
        raise ValueError(f"the prompt holds {len(pieces) - 1} image markers ({marker}) for {num_images} images")
    return pieces
