"""A mixture-of-experts block's per-expert path beside its grouped one (models/layers/moe.py)."""

from __future__ import annotations

import torch

from opentgi.models.layers.moe import SparseMoE


def per_expert(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """`block(x)` through its per-expert loop: the grouped experts set aside for the call."""
    grouped, block.grouped = block.grouped, None
    try:
        return block(x)
    finally:
        block.grouped = grouped
