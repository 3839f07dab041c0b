"""Qwen2.5-VL's image encoder: a ViT over 14 x 14 patches of 2 frames (an image is its own second
frame), with 2D rotary position embeddings, attention within windows of `window_size` pixels
except in the `fullatt_block_indexes` blocks (the whole image), then the merger (RMSNorm, 2 x 2
neighbouring patches concatenated, a two-layer GELU MLP into the text model's hidden size). Its
output rows replace the embeddings of the prompt's `<|image_pad|>` tokens; the text model is the
Qwen2 decoder of families/decoder.py with M-RoPE (layers/rotary.py), whose per-token positions
`mrope_positions` gives.

Parameter names are the checkpoint's under `visual.` (or `model.visual.`), renamed to `vision.`
(checkpoints/text_tower.py). The patch embedding is the checkpoint's Conv3d, applied as the
matrix product it is (its stride is its kernel). Attention runs per window (and per image in the
full-attention blocks): the windows of a step, padded to the longest, as one batched attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Qwen2's RMSNorm: computed in float32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [patches, channels * frames * p * p] (the processor's layout) -> [patches, hidden]."""
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """Attention within each segment cu[i]:cu[i + 1] of the rows (q, k, v [N, heads, d]), every
    segment padded to the longest and attended as one batch. -> [N, heads, d]."""
    lengths = [b - a for a, b in zip(cu, cu[1:]) if b > a]
    starts = [a for a, b in zip(cu, cu[1:]) if b > a]
    longest = max(lengths)
    offsets = torch.arange(longest)
    index = torch.tensor(starts).unsqueeze(1) + offsets  # [segments, longest]
    valid = offsets < torch.tensor(lengths).unsqueeze(1)
    index = torch.where(valid, index, 0).to(q.device)

    def batch(t: torch.Tensor) -> torch.Tensor:  # [segments, heads, longest, d]
        return t[index].transpose(1, 2)

    mask = None if all(n == longest for n in lengths) else valid.to(q.device)[:, None, None, :]
    out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)[valid.to(q.device)]


class VisionAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = segment_attention(q, k, v, cu, self.head_dim ** -0.5)
        return self.proj(out.reshape(n, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The vision tower's rotary embedding, in float32 as transformers applies it."""
    h = x.float()
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + rotated * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r} (the paged Qwen2.5-VL tower has silu)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cu, cos, sin):
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2_5_VLVision(nn.Module):
    """The image encoder: `encode(pixel_values, grids)` of one or more images -> the rows of their
    `<|image_pad|>` tokens, in prompt order."""

    mrope = True  # its tokens' positions in the text model: `mrope_positions`

    def __init__(self, config):
        super().__init__()
        cfg = config.vision_config
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.merge = cfg.spatial_merge_size
        self.full_attention = set(cfg.fullatt_block_indexes)
        self.window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # in merged patches
        self.rotary_dim = cfg.hidden_size // cfg.num_heads // 2

    def rotary(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[patches, head_dim / 2]: each patch's (row, column) angles, patches in the merger's order
        (2 x 2 neighbours together)."""
        m = self.merge
        ids = []
        for t, h, w in grids:
            rows = torch.arange(h).unsqueeze(1).expand(-1, w)
            cols = torch.arange(w).unsqueeze(0).expand(h, -1)

            def merged(a: torch.Tensor) -> torch.Tensor:
                return a.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()

            ids.append(torch.stack([merged(rows), merged(cols)], dim=-1).repeat(t, 1))
        ids = torch.cat(ids)
        longest = max(max(h, w) for _, h, w in grids)
        # computed here, on the CPU: the model is built on the meta device
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device="cpu")
                                      / self.rotary_dim))
        freqs = torch.outer(torch.arange(longest, dtype=torch.float, device="cpu"), inv_freq)
        return freqs[ids].flatten(1)

    def windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """(the merged patches' order grouped by window, the windows' bounds in patches): windows
        of `window` x `window` merged patches from each image's top left, cut at its edges."""
        order, bounds, base = [], [0], 0
        size, unit = self.window, self.merge ** 2
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).reshape(t, gh, gw)
            pad_h, pad_w = size - gh % size, size - gw % size
            nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
            padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
            padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size * size)
            for window in padded.reshape(-1, size * size):
                kept = window[window >= 0]
                if kept.numel():
                    order.append(kept + base)
                    bounds.append(bounds[-1] + kept.numel() * unit)
            base += t * gh * gw
        return torch.cat(order), bounds

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [patches, channels * frames * p * p] of the images whose patch grids (t, h,
        w) are `grids`, in order -> [tokens, text hidden] (each image's t * h * w / merge^2 rows)."""
        weight = self.merger.mlp[0].weight
        x = self.patch_embed(pixel_values.to(weight.device))
        unit = self.merge ** 2
        n = x.shape[0]
        order, window_bounds = self.windows(grids)
        order = order.to(x.device)
        x = x.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        angles = self.rotary(grids).to(x.device)
        angles = angles.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        image_bounds = [0]
        for t, h, w in grids:
            image_bounds.extend(image_bounds[-1] + h * w * (i + 1) for i in range(t))
        for i, block in enumerate(self.blocks):
            x = block(x, image_bounds if i in self.full_attention else window_bounds, cos, sin)
        out = self.merger(x)
        return out[torch.argsort(order)]

    def encode_images(self, images: list, batched: bool) -> None:
        """Set `embeds` of each ImageInput: each image alone, or (`batched`) all in one pass."""
        groups = [images] if batched else [[image] for image in images]
        for group in groups:
            rows = self.encode(torch.cat([i.pixel_values for i in group]), [i.grid for i in group])
            for image, part in zip(group, rows.split([len(i.positions) for i in group])):
                image.embeds = part

    def mrope_positions(self, images: list, start: int, end: int) -> torch.Tensor:
        """int64 [3, end - start]: the M-RoPE (temporal, height, width) positions of prompt or
        generated tokens start..end - 1 of a sequence with these images (ImageInputs in prompt
        order), as transformers' `get_rope_index` gives them: a text token's three are its index
        less what the images before it saved; an image's tokens sit at its first position plus
        (0, row, column) of its merged grid, and the text after it resumes one past its largest."""
        positions = torch.arange(start, end).unsqueeze(0).repeat(3, 1)
        shift = 0
        for image in images:
            t, h, w = image.grid
            h, w = h // self.merge, w // self.merge
            first = image.start + shift
            lo, hi = max(start, image.start), min(end, image.end)
            if lo < hi:
                j = torch.arange(lo - image.start, hi - image.start) % (h * w)
                positions[0, lo - start:hi - start] = first
                positions[1, lo - start:hi - start] = first + j // w
                positions[2, lo - start:hi - start] = first + j % w
            saved = max(h, w) - t * h * w
            if image.end < end:
                positions[:, max(start, image.end) - start:] += saved
            shift += saved
        return positions
