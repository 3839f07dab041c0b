"""Which rows of a step are prompt tokens and which are generated ones.

A layer may pick its kernel by a row's kind, never by the step's row count (docs/determinism.md):
a quantized layer multiplies prompt rows through a dense copy of its weight and generated rows
(decode and speculative verify rows) through its quantized kernel (models/quantization/linear.py).
A token's kind is fixed by its position: before the prompt's end it is a prompt token, however the
prompt is split (chunks, a prefix-cache hit); from there on it is a generated token, also when
recomputed after a preemption.

The model runner sets the kinds around one forward (`step_row_kinds`); a forward without them
(the logits heads, other callers) multiplies every row as a generated one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

PROMPT, GENERATED, MIXED = "prompt", "generated", "mixed"


class RowKinds:
    """The kinds of a step's T flat rows; for a mixed step the row indices of each kind."""

    def __init__(self, prompt_rows_per_seq: Sequence[int], rows_per_seq: Sequence[int], device: torch.device):
        """Sequence b feeds rows_per_seq[b] rows, its first prompt_rows_per_seq[b] of them prompt
        tokens (a sequence's prompt tokens come before its generated ones)."""
        self.num_rows = sum(rows_per_seq)
        num_prompt = sum(prompt_rows_per_seq)
        self.kind = PROMPT if num_prompt == self.num_rows else GENERATED if num_prompt == 0 else MIXED
        self.prompt_index = self.generated_index = None
        if self.kind == MIXED:  # a row is a prompt row while its offset in its sequence is below the count
            counts = torch.tensor(rows_per_seq, dtype=torch.int64)
            prompt = torch.tensor(prompt_rows_per_seq, dtype=torch.int64)
            offset = torch.arange(self.num_rows) - (counts.cumsum(0) - counts).repeat_interleave(counts)
            is_prompt = offset < prompt.repeat_interleave(counts)
            self.prompt_index = is_prompt.nonzero().squeeze(1).to(device)
            self.generated_index = (~is_prompt).nonzero().squeeze(1).to(device)


_CURRENT: ContextVar[RowKinds | None] = ContextVar("opentgi_row_kinds", default=None)


@contextmanager
def step_row_kinds(kinds: RowKinds | None) -> Iterator[None]:
    token = _CURRENT.set(kinds)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_row_kinds() -> RowKinds | None:
    return _CURRENT.get()
