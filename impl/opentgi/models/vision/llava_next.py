"""LLaVA-NeXT's image encoder: a CLIP vision transformer over the image's tiles (the base image, the
whole image at the tower's size, first; then the tiles of its any-resolution grid), the hidden
states of `vision_feature_layer` (or of several layers, concatenated; the tower's final norm is
never applied), the class token dropped (`default`), the two-layer GELU projector into the text
model's hidden size, and the tiles' features put back together as transformers'
`pack_image_features` does: the grid's features in rows, the padding the preprocessing added to
fit the grid cut off again (`unpadded`), `image_newline` after each row, the base image's
features in front. Its output rows replace the embeddings of the prompt's `<image>` tokens; the
text model is the Llama (or Mistral) decoder.

Parameter names are the checkpoint's under `vision_tower.`, `multi_modal_projector.` and
`image_newline` (or the same under `model.`), renamed to `vision.tower.`, `vision.projector.`
and `vision.image_newline` (checkpoints/text_tower.py).
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.models.vision.idefics3 import VisionLayer

ACTIVATIONS = {"gelu": nn.GELU(), "gelu_pytorch_tanh": nn.GELU(approximate="tanh")}


def grid_of(size: tuple[int, int], pinpoints: list, tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles for an image of `size` (height, width): the any-resolution grid
    the preprocessing picks (transformers' `select_best_resolution`), in tiles of `tile` pixels."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(list(size), pinpoints)
    return height // tile, width // tile


def unpadded(size: tuple[int, int], height: int, width: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the image's own features within a `height` x `width` grid of
    features of it resized and padded to fit (centred), as transformers' `unpad_image`."""
    original_height, original_width = size
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        pad = (height - new_height) // 2
        return pad, height - pad, 0, width
    new_width = int(round(original_width * (height / original_height), 7))
    pad = (width - new_width) // 2
    return 0, height, pad, width - pad


def image_tokens(size: tuple[int, int], pinpoints: list, tile: int, patch: int) -> int:
    """How many `<image>` tokens an image of `size` (height, width) takes: the base image's
    features, the grid's unpadded features and one newline per row of them."""
    rows, cols = grid_of(size, pinpoints, tile)
    side = tile // patch
    top, bottom, left, right = unpadded(size, rows * side, cols * side)
    return side * side + (bottom - top) * (right - left + 1)


class CLIPEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size,
                                         bias=False)
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2 + 1, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1).to(x.dtype)
        return torch.cat([cls, x], dim=1) + self.position_embedding.weight


class CLIPEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList([VisionLayer(cfg) for _ in range(cfg.num_hidden_layers)])


class CLIPTower(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = CLIPEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = CLIPEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # loaded, never read

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> torch.Tensor:
        """[tiles, 3, S, S] -> [tiles, 1 + patches, hidden * len(layers)]: the hidden states after
        each of `layers` layers (0: the embeddings after the first norm), concatenated."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers[:max(layers)]:
            x = layer(x, None)
            states.append(x)
        return torch.cat([states[i] for i in layers], dim=-1)


class CLIPVisionModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.vision_model = CLIPTower(cfg)


class Projector(nn.Module):
    def __init__(self, config, layers: int):
        super().__init__()
        text, bias = config.text_config.hidden_size, getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * layers, text, bias=bias)
        self.linear_2 = nn.Linear(text, text, bias=bias)
        act = getattr(config, "projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {act!r} (the paged LLaVA-NeXT projector has {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaNextVision(nn.Module):
    """The image encoder: `encode(pixel_values, sizes)` of one or more images -> the rows of their
    `<image>` tokens, in prompt order."""

    def __init__(self, config):
        super().__init__()
        vision = config.vision_config
        if getattr(vision, "model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"a {vision.model_type} vision tower (the paged LLaVA-NeXT has CLIP's)")
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy != "default":  # CLIP's class token would not fit the tiles' grid of features
            raise ValueError(f"vision_feature_select_strategy {strategy!r} with a CLIP tower (the paged "
                             f"LLaVA-NeXT has 'default')")
        chosen = config.vision_feature_layer
        chosen = [chosen] if isinstance(chosen, int) else list(chosen)
        depth = vision.num_hidden_layers
        self.layers = [i % (depth + 1) for i in chosen]  # hidden_states[i]: 0 is the embeddings
        self.tower = CLIPVisionModel(vision)
        self.projector = Projector(config, len(chosen))
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))
        self.pinpoints = [list(p) for p in config.image_grid_pinpoints]
        self.tile, self.side = vision.image_size, vision.image_size // vision.patch_size

    def pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's projected features [tiles, side * side, hidden] -> its token rows."""
        base, grid = features[0], features[1:]
        rows, cols = grid_of(size, self.pinpoints, self.tile)
        s, d = self.side, features.shape[-1]
        grid = grid.reshape(rows, cols, s, s, d).permute(0, 2, 1, 3, 4).reshape(rows * s, cols * s, d)
        top, bottom, left, right = unpadded(size, rows * s, cols * s)
        grid = grid[top:bottom, left:right]
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, d)
        return torch.cat([base, torch.cat([grid, newline], dim=1).reshape(-1, d)])

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, sizes: list[tuple[int, int]]) -> torch.Tensor:
        """pixel_values [tiles, 3, S, S] of the images of (height, width) `sizes`, in order (each
        image's base tile first) -> [tokens, text hidden]."""
        weight = self.projector.linear_1.weight
        pixels = pixel_values.to(device=weight.device, dtype=weight.dtype)
        hidden = self.tower.vision_model(pixels, self.layers)[:, 1:]  # `default`: the class token dropped
        features = self.projector(hidden)
        counts = [1 + r * c for r, c in (grid_of(size, self.pinpoints, self.tile) for size in sizes)]
        return torch.cat([self.pack(f, size) for f, size in zip(features.split(counts), sizes)])

    def encode_images(self, images: list, batched: bool) -> None:
        """Set `embeds` of each ImageInput: each image alone, or (`batched`) all in one pass."""
        groups = [images] if batched else [[image] for image in images]
        for group in groups:
            rows = self.encode(torch.cat([i.pixel_values for i in group]), [i.size for i in group])
            for image, part in zip(group, rows.split([len(i.positions) for i in group])):
                image.embeds = part
