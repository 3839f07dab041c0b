"""Kirchenbauer et al. soft watermark ("A Watermark for Large Language Models", 2023), as TGI does it.

Before each token, the previous token seeds a `torch.Generator` on the logits' device with
`15485863 * previous_token_id`; the first `int(vocab_size * gamma)` ids of
`torch.randperm(vocab_size, generator=g)` are the "green list" and get `delta` added to their logits.
This is TGI's `WatermarkLogitsProcessor` permutation exactly (server/text_generation_server/utils/
watermark.py), so text from either server is detected with the same key. One deliberate difference:
TGI's batched path reads "the previous token" from the last column of the batch's padded input-id
tensor, which for rows shorter than the longest is padding; here each sequence is seeded by its real
previous token (the last prompt token for the first generated token), which is what the paper and
the detector below assume.

A detector counts green tokens: z = (green - gamma*T) / sqrt(T*gamma*(1-gamma)) over the T scored
tokens; unwatermarked text has z ~ N(0, 1), watermarked text grows like sqrt(T).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HASH_KEY = 15485863  # TGI's key: a large prime giving the seed enough bits


class _GreenListCache:
    """LRU of green-list masks by (vocab size, gamma, device, previous token): a vocabulary-wide
    randperm costs several times what adding a cached mask does, and previous tokens repeat."""

    def __init__(self, max_entries: int = 256):
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    def get(self, vocab_size: int, gamma: float, prev_token: int, device: torch.device) -> torch.Tensor:
        key = (vocab_size, gamma, str(device), prev_token)
        with self._lock:
            mask = self._masks.get(key)
            if mask is not None:
                self._masks.move_to_end(key)
                return mask
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[greenlist_ids(vocab_size, gamma, prev_token, device)] = True
        with self._lock:
            self._masks[key] = mask
            while len(self._masks) > self._max_entries:
                self._masks.popitem(last=False)
        return mask


_green_lists = _GreenListCache()


def greenlist_ids(vocab_size: int, gamma: float, prev_token: int, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """The green list after `prev_token`: TGI's `_get_greenlist_ids`."""
    g = torch.Generator(device=device)
    g.manual_seed(HASH_KEY * prev_token)
    return torch.randperm(vocab_size, device=device, generator=g)[: int(vocab_size * gamma)]


class WatermarkProcessor:
    """Per-sequence RowLogitsProcessor (engine/sampling/processors.py): adds delta to the green list seeded by
    the sequence's previous token."""

    __slots__ = ("delta", "gamma", "prev_token", "vocab_size")

    def __init__(self, vocab_size: int, gamma: float, delta: float, last_prompt_token: int):
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.delta = delta
        self.prev_token = last_prompt_token

    def __call__(self, logits: torch.Tensor) -> None:
        mask = _green_lists.get(self.vocab_size, self.gamma, self.prev_token, logits.device)
        width = logits.shape[-1]
        if width < self.vocab_size:
            mask = mask[:width]
        elif width > self.vocab_size:
            mask = torch.nn.functional.pad(mask, (0, width - self.vocab_size))
        logits.add_(mask, alpha=self.delta)

    def accept(self, token_id: int) -> None:
        self.prev_token = token_id

    def is_terminated(self) -> bool:
        return False


def make_watermark_processor(vocab_size: int, gamma: float, delta: float, last_prompt_token: int
                             ) -> WatermarkProcessor:
    return WatermarkProcessor(vocab_size, gamma, delta, last_prompt_token)


@dataclass(frozen=True)
class WatermarkDetection:
    z_score: float
    green_fraction: float
    is_watermarked: bool
    num_scored_tokens: int = 0


def detect_watermark(token_ids: Sequence[int], vocab_size: int, gamma: float, z_threshold: float = 4.0, *,
                     last_prompt_token: int | None = None, device: torch.device | str = "cpu"
                     ) -> WatermarkDetection:
    """Score generated tokens for the watermark.

    Each token is scored against the green list of the token before it. Pass `last_prompt_token` to
    score the first generated token too; without it `token_ids[0]` only seeds the next one. `device`
    must be the device type that generated the text (CUDA and CPU generators give different lists).
    """
    ids = list(token_ids) if last_prompt_token is None else [last_prompt_token, *token_ids]
    scored = len(ids) - 1
    if scored < 1:
        return WatermarkDetection(0.0, 0.0, False, 0)
    green = 0
    for prev, tok in itertools.pairwise(ids):
        if 0 <= tok < vocab_size and _green_lists.get(vocab_size, gamma, prev, torch.device(device))[tok]:
            green += 1
    expected = gamma * scored
    z = (green - expected) / math.sqrt(scored * gamma * (1 - gamma))
    return WatermarkDetection(z, green / scored, z > z_threshold, scored)
