"""Concatenating quantized weights (fusing q/k/v and gate/up at load) on one thread.

A concatenation is a memory copy, which one thread does at memory speed. Spread over an OpenMP team
of two on a 2-core machine whose other core is busy, each call waits for the team's descheduled
thread: measured on the 1B GGUF's gate/up (16 MiB of packed int4), 20-40 ms a call on two threads
against 1.5 ms on one, 1-2.5 s of a start for the 32 fusions.
"""

from __future__ import annotations

import torch


def cat_serially(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """`torch.cat(tensors, dim)`, on one thread for CPU tensors (the caller's count is restored)."""
    threads = torch.get_num_threads()
    if threads == 1 or tensors[0].device.type != "cpu":
        return torch.cat(tensors, dim)
    torch.set_num_threads(1)
    try:
        return torch.cat(tensors, dim)
    finally:
        torch.set_num_threads(threads)
