"""Sizing the KV pool from device memory, after a profiling step at the largest batch.

TGI's rule (`--cuda-memory-fraction`, default 1.0): the server may use that fraction of the GPU's
total memory. After the weights are loaded, one forward of the largest step the scheduler can form
(a full prefill chunk plus one decode row for every other sequence that may run beside it, and the
logits of every row) is run on a temporary cache; what it needed on top of the weights at its peak is
kept free for the steps to come, and the KV pool gets the rest:

    kv_budget = free - (1 - cuda_memory_fraction) * total - step_peak

where `free`/`total` come from `torch.cuda.mem_get_info` after the profiling step (torch's cache
emptied). The device queries sit behind `DeviceMemory`, so the arithmetic runs on CPU in tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Protocol

import torch


class StepRunner(Protocol):
    def execute(self, seqs, num_new_tokens: list[int], sample_rows: list[int]): ...


class DeviceMemory(Protocol):
    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes on the device
    def memory_allocated(self) -> int: ...  # bytes held by live tensors
    def max_memory_allocated(self) -> int: ...  # their peak since reset_peak_memory_stats
    def reset_peak_memory_stats(self) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self) -> None: ...


class CudaMemory:
    """DeviceMemory of one CUDA device (torch.cuda)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class NotEnoughMemoryError(RuntimeError):
    """The KV pool would not hold one block: a start-up error with what to change."""


@dataclass(frozen=True)
class MemoryProfile:
    free: int  # bytes free on the device after the profiling step
    total: int  # the device's memory
    step_peak: int  # bytes the largest step allocated on top of what was live before it

    def kv_budget(self, cuda_memory_fraction: float) -> int:
        reserved = (1.0 - cuda_memory_fraction) * self.total
        return max(0, int(self.free - reserved - self.step_peak))


@dataclass(frozen=True)
class StepShape:
    """The largest step: one prefill row of `prefill_tokens` and `decode_rows` one-token rows."""

    prefill_tokens: int
    decode_rows: int

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_rows


def profile_step(make_runner: Callable[[int], StepRunner], block_size: int, shape: StepShape,
                 memory: DeviceMemory) -> MemoryProfile:
    """Run the largest step once on a temporary cache (every row's table points at the same few
    blocks: the values do not matter, the working memory does) and measure. `make_runner(num_blocks)`
    builds the runner over a pool of that many blocks: profiling needs a runner, not which one."""
    memory.synchronize()
    memory.empty_cache()
    before = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    num_blocks = max(1, math.ceil(shape.prefill_tokens / block_size))
    runner = make_runner(num_blocks)
    cache_bytes = memory.memory_allocated() - before  # the temporary pool is not working memory
    table = list(range(num_blocks))
    rows = [SimpleNamespace(token_ids=[0] * shape.prefill_tokens, num_computed_tokens=0, block_table=table,
                            draft_token_ids=[])]
    rows += [SimpleNamespace(token_ids=[0], num_computed_tokens=0, block_table=table[:1], draft_token_ids=[])
             for _ in range(shape.decode_rows)]
    runner.execute(rows, [shape.prefill_tokens] + [1] * shape.decode_rows, sample_rows=list(range(len(rows))))
    memory.synchronize()
    step_peak = max(0, memory.max_memory_allocated() - before - cache_bytes)
    del runner, rows
    memory.empty_cache()
    free, total = memory.mem_get_info()
    return MemoryProfile(free=free, total=total, step_peak=step_peak)
