"""KV pool sizing from device memory (--cuda-memory-fraction), on CPU with a faked memory API."""

from __future__ import annotations

import pytest
import torch

from opentgi.cli import build_parser, settings_from
from opentgi.config import Settings
from opentgi.engine.execution.assembly import build_runner, largest_step
from opentgi.engine.execution.gpu_memory import MemoryProfile, NotEnoughMemoryError, StepShape
from opentgi.engine.execution.kv_cache import bytes_per_block, num_kv_blocks
from opentgi.models.loader import load_model, resolve_dtype

GIB = 1 << 30


class FakeMemory:
    """A device with `total` bytes of which `free` are free after the profiling step; live tensors
    hold `weights` bytes, the temporary profiling pool `pool` more, and the step peaks `step` above."""

    def __init__(self, free: int, total: int, weights: int = 3000, pool: int = 700, step: int = 5000):
        self.free, self.total = free, total
        self.allocated = [weights, weights + pool]  # before the profiling pool, after it
        self.peak = weights + pool + step
        self.calls: list[str] = []

    def mem_get_info(self):
        self.calls.append("mem_get_info")
        return self.free, self.total

    def memory_allocated(self):
        self.calls.append("memory_allocated")
        return self.allocated.pop(0)

    def max_memory_allocated(self):
        self.calls.append("max_memory_allocated")
        return self.peak

    def reset_peak_memory_stats(self):
        self.calls.append("reset_peak_memory_stats")

    def empty_cache(self):
        self.calls.append("empty_cache")

    def synchronize(self):
        self.calls.append("synchronize")


def test_budget_is_tgis_fraction_of_total_less_the_largest_step():
    profile = MemoryProfile(free=60 * GIB, total=80 * GIB, step_peak=2 * GIB)
    assert profile.kv_budget(1.0) == 58 * GIB
    assert profile.kv_budget(0.9) == 50 * GIB  # 8 GiB of the device kept back
    assert MemoryProfile(free=GIB, total=80 * GIB, step_peak=0).kv_budget(0.5) == 0


def test_blocks_from_a_profile_and_a_clear_error_when_none_fit(tiny_llama):
    spec = load_model(Settings(model_id=str(tiny_llama))).spec
    per_block = bytes_per_block(spec, 16)
    profile = MemoryProfile(free=1000 * per_block, total=2000 * per_block, step_peak=100 * per_block)
    assert num_kv_blocks(Settings(), spec, 16, profile=profile) == 900
    assert num_kv_blocks(Settings(cuda_memory_fraction=0.9), spec, 16, profile=profile) == 700
    assert num_kv_blocks(Settings(), spec, 16, max_useful_tokens=160, profile=profile) == 10
    assert num_kv_blocks(Settings(max_batch_total_tokens=64), spec, 16, profile=profile) == 4  # explicit wins
    with pytest.raises(NotEnoughMemoryError, match="raise --cuda-memory-fraction"):
        num_kv_blocks(Settings(cuda_memory_fraction=0.5), spec, 16, profile=profile)


def test_build_runner_profiles_the_largest_step_then_sizes_the_pool(tiny_llama, monkeypatch):
    settings = Settings(model_id=str(tiny_llama), max_batch_size=6, chunked_prefill_tokens=40,
                        cuda_memory_fraction=0.75, kv_cache_dtype="float32")  # blocks of the model's dtype
    loaded = load_model(settings)
    per_block = bytes_per_block(loaded.spec, loaded.block_size)
    memory = FakeMemory(free=1000 * per_block, total=1200 * per_block, step=50 * per_block)
    seen = []
    forward = loaded.model.forward
    monkeypatch.setattr(loaded.model, "forward", lambda ids, *a: seen.append(ids.shape[0]) or forward(ids, *a))
    compute_logits = loaded.model.compute_logits
    monkeypatch.setattr(loaded.model, "compute_logits", lambda h: seen.append(("logits", h.shape[0]))
                        or compute_logits(h))
    runner, spec, num_blocks, block_size = build_runner(loaded, settings, memory=memory)
    assert largest_step(settings, spec) == StepShape(prefill_tokens=40, decode_rows=5)
    assert seen == [45, ("logits", 6)]  # one forward: a 40-token chunk beside 5 decodes, every row sampled
    # 1000 free - 300 kept back (0.25 of 1200) - 50 for the step
    assert num_blocks == 650 and runner.num_blocks == 650
    assert memory.calls.index("reset_peak_memory_stats") < memory.calls.index("max_memory_allocated") \
        < memory.calls.index("mem_get_info")


def test_largest_step_without_chunking_is_a_whole_prefill_batch():
    settings = Settings(chunked_prefill_tokens=None, max_batch_prefill_tokens=3000, max_concurrent_requests=10,
                        max_best_of=2)
    spec = type("Spec", (), {"max_position_embeddings": 8192})()
    assert largest_step(settings, spec) == StepShape(prefill_tokens=3000, decode_rows=19)


def test_cuda_memory_fraction_flag_and_env():
    parser = build_parser()
    assert settings_from(parser.parse_args(["serve"]), {}).cuda_memory_fraction == 1.0
    assert settings_from(parser.parse_args(["serve"]), {"CUDA_MEMORY_FRACTION": "0.8"}).cuda_memory_fraction == 0.8
    args = parser.parse_args(["serve", "--cuda-memory-fraction", "0.5"])
    assert settings_from(args, {"CUDA_MEMORY_FRACTION": "0.8"}).cuda_memory_fraction == 0.5
    with pytest.raises(SystemExit, match="cuda-memory-fraction"):
        settings_from(parser.parse_args(["serve", "--cuda-memory-fraction", "1.5"]), {})


def test_bfloat16_is_the_default_on_cuda():
    assert resolve_dtype(Settings(), torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(Settings(dtype="float16"), torch.device("cuda")) == torch.float16
