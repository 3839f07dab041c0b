"""Concatenating quantized weights (fusing q/k/v and gate/up at load) on one thread.

A concatenation is a memory copy, which one thread does at memory speed. Spread over an OpenMP
team on a machine whose other cores are busy, each call waits for the team's descheduled threads,
which adds up to seconds of a start over a model's fusions (docs/cpu.md).
"""

from __future__ import annotations

import torch


def cat_on_one_thread(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """`torch.cat(tensors, dim)`, on one thread for CPU tensors (the caller's count is restored)."""
    threads = torch.get_num_threads()
    if threads == 1 or tensors[0].device.type != "cpu":
        return torch.cat(tensors, dim)
    torch.set_num_threads(1)
    try:
        return torch.cat(tensors, dim)
    finally:
        torch.set_num_threads(threads)
