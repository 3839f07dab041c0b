"""Idefics3's (SmolVLM's) image encoder: a SigLIP vision transformer over each tile of an image,
then the connector (pixel shuffle by `scale_factor`, one linear projection into the text model's
hidden size). Its output rows replace the embeddings of the prompt's `<image>` tokens; the text
model is the Llama decoder of families/decoder.py.

Parameter names are the checkpoint's under `model.vision_model.` and `model.connector.`, renamed
to `vision.vision_model.` and `vision.connector.` (checkpoints/text_tower.py).

Position ids follow the fixed upstream code (and vLLM): a tile of h x w patches takes the bucket
of arange(0, 1 - 1e-6, 1 / h) (and w) among the `num_patches_per_side` buckets. transformers
4.55-4.57 computes `i / h * (1 - 1e-6)` in float32 instead, which falls one bucket short.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.side = cfg.image_size // cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(self.side * self.side, cfg.hidden_size)

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, patches] position ids of each tile's valid patches (0 on padding)."""
        side = self.side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        ids = torch.zeros(patch_mask.shape[0], patch_mask[0].numel(), dtype=torch.long)
        for tile, mask in enumerate(patch_mask.cpu()):
            nb_h, nb_w = int(mask[:, 0].sum()), int(mask[0].sum())
            h = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / nb_h), boundaries, right=True)
            w = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / nb_w), boundaries, right=True)
            ids[tile][mask.reshape(-1)] = (h[:, None] * side + w).flatten()
        return ids.to(self.position_embedding.weight.device)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(patch_mask))


class VisionAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        hidden = cfg.hidden_size
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, hidden))


class VisionMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        act = cfg.hidden_act
        if act not in ("gelu_pytorch_tanh", "gelu", "quick_gelu"):
            raise ValueError(f"vision hidden_act {act!r} (the paged SigLIP and CLIP towers have gelu, "
                             f"gelu_pytorch_tanh and quick_gelu)")
        self.act = act
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h * torch.sigmoid(1.702 * h) if self.act == "quick_gelu" else F.gelu(h, approximate=self.approximate)
        return self.fc2(h)


class VisionLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList([VisionLayer(cfg) for _ in range(cfg.num_hidden_layers)])


class VisionTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values, patch_mask)
        keys = patch_mask.reshape(patch_mask.shape[0], 1, 1, -1)
        mask = None if bool(keys.all()) else torch.zeros(keys.shape, dtype=x.dtype, device=x.device).masked_fill(
            ~keys, torch.finfo(x.dtype).min)
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int):
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(vision_hidden * scale_factor ** 2, text_hidden)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[tiles, side * side, d] -> [tiles, side * side / s^2, d * s^2], as Idefics3's own."""
        s = self.scale_factor
        b, seq, d = x.shape
        side = int(seq ** 0.5)
        x = x.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(b, seq // (s * s), d * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))


class Idefics3Vision(nn.Module):
    """The image encoder: `encode(pixel_values, pixel_mask)` of one image's tiles -> the rows of
    its `<image>` tokens, in prompt order."""

    def __init__(self, config):
        super().__init__()
        vision = config.vision_config
        self.patch_size = vision.patch_size
        self.vision_model = VisionTransformer(vision)
        self.connector = Connector(vision.hidden_size, config.text_config.hidden_size, config.scale_factor)

    def patch_mask(self, pixel_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, H, W] pixel mask -> [tiles, H/p, W/p]: patches holding any real pixel."""
        p = self.patch_size
        return pixel_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """pixel_values [tiles, 3, H, W], pixel_mask [tiles, H, W] -> [tiles * tokens_per_tile, hidden]."""
        weight = self.connector.modality_projection.proj.weight
        pixels = pixel_values.to(device=weight.device, dtype=weight.dtype)
        hidden = self.vision_model(pixels, self.patch_mask(pixel_mask.to(weight.device)))
        out = self.connector(hidden)
        return out.reshape(-1, out.shape[-1])

    def encode_images(self, images: list, batched: bool) -> None:
        """Set `embeds` of each ImageInput: each image alone, or (`batched`) the images of one tile
        size in one pass."""
        if not batched:
            for image in images:
                image.embeds = self.encode(image.pixel_values, image.pixel_mask)
            return
        groups: dict[tuple, list] = {}
        for image in images:
            groups.setdefault(tuple(image.pixel_values.shape[1:]), []).append(image)
        for group in groups.values():
            rows = self.encode(torch.cat([i.pixel_values for i in group]), torch.cat([i.pixel_mask for i in group]))
            for image, part in zip(group, rows.split([len(i.positions) for i in group])):
                image.embeds = part
