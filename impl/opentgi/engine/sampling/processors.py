"""Per-row logits processors: the hook through which grammar masks (and other per-sequence
constraints) reach the batched sampler."""

from __future__ import annotations

from typing import Protocol

import torch


class RowLogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor) -> None:
        """Mask/modify this row's float32 logits [vocab] in place, before the warpers."""

    def accept(self, token_id: int) -> None:
        """The sampler chose token_id for this row."""

    def is_terminated(self) -> bool:
        """True once nothing more may be generated (the grammar is complete)."""
