"""Sizing and allocating the paged KV pool.

One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]. The
pool holds `max_batch_total_tokens` tokens when that is set; else, on CUDA, what the memory profile
leaves (`gpu_memory.py`: `--cuda-memory-fraction` of the device, less the largest step's working
memory), and on CPU as many as `kv_cache_cpu_bytes` buys.

The pool's dtype is `--kv-cache-dtype` (`kv_cache_dtype`): by default float16 where the model
computes in float32 on CPU (hosts without native bfloat16), as llama.cpp keeps its cache: a long
context's decode step reads the cache more than the weights, and float16 halves those bytes (and
the pool's memory) for keys and values rounded to 11 significant bits; elsewhere the model's dtype.
"""

from __future__ import annotations

import math
import mmap

import torch

from opentgi.config import Settings
from opentgi.engine.execution.gpu_memory import MemoryProfile, NotEnoughMemoryError
from opentgi.models.base import ModelSpec

_KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_cache_dtype(settings: Settings, spec: ModelSpec) -> torch.dtype:
    """The pool's dtype for `settings.kv_cache_dtype` (module docstring). A dtype other than the
    model's is served on CPU only: flash-attn reads its cache in the model's dtype."""
    choice = settings.kv_cache_dtype
    on_cpu = torch.device(spec.device).type == "cpu"
    if choice == "auto":
        return torch.float16 if on_cpu and spec.dtype == torch.float32 else spec.dtype
    if choice not in _KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be auto, float16, bfloat16 or float32, got {choice!r}")
    dtype = _KV_DTYPES[choice]
    if dtype != spec.dtype and not on_cpu:
        raise ValueError(f"--kv-cache-dtype {choice}: on {torch.device(spec.device).type} the KV cache is in "
                         f"the model's dtype ({str(spec.dtype)[6:]}); another one is served on CPU only")
    return dtype


def bytes_per_block(spec: ModelSpec, block_size: int) -> int:
    itemsize = torch.empty((), dtype=spec.cache_dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize


def num_kv_blocks(settings: Settings, spec: ModelSpec, block_size: int, max_useful_tokens: int | None = None,
                  profile: MemoryProfile | None = None) -> int:
    """How many blocks the pool gets (at least one). Without an explicit max_batch_total_tokens, a
    memory budget that buys more than `max_useful_tokens` (every concurrent request at the full
    context) is trimmed to it: tiny models would otherwise get millions of tokens nobody can use.
    `profile`: the device's memory after the profiling step (GPU); None sizes from the CPU budget."""
    per_block = bytes_per_block(spec, block_size)
    if settings.max_batch_total_tokens is not None:
        return max(1, -(-settings.max_batch_total_tokens // block_size))
    if profile is not None:
        budget = profile.kv_budget(settings.cuda_memory_fraction)
        if budget < per_block:
            gib = 1 << 30
            raise NotEnoughMemoryError(
                f"no GPU memory left for the KV cache: {profile.free / gib:.2f} GiB free of "
                f"{profile.total / gib:.2f} GiB, the largest step needs {profile.step_peak / gib:.2f} GiB, "
                f"--cuda-memory-fraction {settings.cuda_memory_fraction} keeps "
                f"{(1 - settings.cuda_memory_fraction) * profile.total / gib:.2f} GiB back, one block is "
                f"{per_block / gib:.3f} GiB; raise --cuda-memory-fraction or lower "
                f"--max-batch-prefill-tokens / --max-batch-size")
    else:
        budget = settings.kv_cache_cpu_bytes
    num_blocks = budget // per_block
    if max_useful_tokens is not None:
        num_blocks = min(num_blocks, -(-max_useful_tokens // block_size))
    return max(1, num_blocks)


def cache_growth_limit(settings: Settings, spec: ModelSpec, block_size: int, num_blocks: int) -> int:
    """How many blocks the written part of the pool may reach to keep cached prefixes (block
    manager): on CPU, where a block costs memory only once written, `kv_cache_cpu_prefix_bytes`
    worth (128 MiB: 4,096 tokens of a 1B Llama, ~5,800 of the default model); elsewhere, where the
    pool is resident from the start, the whole pool."""
    if torch.device(spec.device).type != "cpu":
        return num_blocks
    return min(num_blocks, settings.kv_cache_cpu_prefix_bytes // bytes_per_block(spec, block_size))


def allocate_kv_caches(spec: ModelSpec, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pool, zero, in spec.cache_dtype. On CPU each tensor is an anonymous memory map: the operating system hands
    out zero pages on first write, so the pool costs resident memory only for the blocks in use.
    The block manager hands out the lowest free block first and reuses written blocks before fresh
    ones, so the written part stays the peak working set and a step faults in fresh pages only
    while that peak grows (a pool handed out in FIFO order would fault in fresh pages in many steps
    until written once through: docs/cpu.md). On GPU, zeros written at once."""
    shape, dtype = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim), spec.cache_dtype
    if torch.device(spec.device).type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=spec.device),
                 torch.zeros(shape, dtype=dtype, device=spec.device)) for _ in range(spec.num_layers)]
    return [(_untouched_zeros(shape, dtype), _untouched_zeros(shape, dtype)) for _ in range(spec.num_layers)]


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor none of whose pages is resident until written (an anonymous mmap; the
    tensor keeps the map alive)."""
    nbytes = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    buffer = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)
