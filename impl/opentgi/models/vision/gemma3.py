"""Gemma 3's image encoder: SigLIP's vision transformer over the whole (square) image (the tower of
idefics3.py, every patch real), then the multi-modal projector (average pooling of the patch grid
down to `mm_tokens_per_image`, Gemma's RMSNorm, one projection into the text model's hidden size).
Its output rows replace the embeddings (after Gemma's embedding scale, as transformers places
them) of the prompt's `<image_soft_token>` tokens, which attend each other both ways in the text
model (`bidirectional`: models/attention/bidirectional.py); the text model is the Gemma 3 decoder.

Parameter names are the checkpoint's under `vision_tower.` and `multi_modal_projector.` (or
`model.vision_tower.` / `model.multi_modal_projector.`), renamed to `vision.` and
`vision.projector.` (checkpoints/text_tower.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.models.vision.idefics3 import VisionTransformer


class Projector(nn.Module):
    def __init__(self, config):
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vision.hidden_size))
        self.eps = vision.layer_norm_eps
        self.patches = vision.image_size // vision.patch_size
        self.kernel = self.patches // int(config.mm_tokens_per_image ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, tokens, text hidden]."""
        b, n, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        h = pooled.float()  # Gemma's RMSNorm: float32, scaled by 1 + weight
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (h * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3Vision(nn.Module):
    """The image encoder: `encode(pixel_values)` of one or more images -> the rows of their
    `<image_soft_token>` tokens, in prompt order."""

    bidirectional = True  # an image's tokens attend each other both ways

    def __init__(self, config):
        super().__init__()
        self.vision_model = VisionTransformer(config.vision_config)
        self.projector = Projector(config)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [images, 3, S, S] -> [images * tokens per image, text hidden]."""
        weight = self.projector.mm_input_projection_weight
        pixels = pixel_values.to(device=weight.device, dtype=weight.dtype)
        side = pixels.shape[-1] // self.vision_model.embeddings.patch_size
        every_patch = torch.ones(pixels.shape[0], side, side, dtype=torch.bool, device=weight.device)
        out = self.projector(self.vision_model(pixels, every_patch))
        return out.reshape(-1, out.shape[-1])

    def encode_images(self, images: list, batched: bool) -> None:
        """Set `embeds` of each ImageInput: each image alone, or (`batched`) all in one pass."""
        groups = [images] if batched else [[image] for image in images]
        for group in groups:
            rows = self.encode(torch.cat([i.pixel_values for i in group]))
            for image, part in zip(group, rows.split([len(i.positions) for i in group])):
                image.embeds = part
