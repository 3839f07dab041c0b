"""Start-up decisions: which runner serves the loaded model, how big the KV pool is, and the limits
the engine reports (settings' `None`s resolved against the model)."""

from __future__ import annotations

import logging

import torch

from opentgi.config import Settings
from opentgi.engine.execution.gpu_memory import (
    CudaMemory,
    DeviceMemory,
    MemoryProfile,
    StepShape,
    profile_step,
)
from opentgi.engine.execution.host_memory import keep_freed_memory
from opentgi.engine.execution.kv_cache import kv_cache_dtype, num_kv_blocks
from opentgi.engine.info import EngineInfo
from opentgi.models.base import ModelSpec
from opentgi.models.registry import PAGED_ARCHITECTURES

log = logging.getLogger(__name__)

DEFAULT_CPU_BLOCK_SIZE = 16


def spec_from_hf_config(model, eos_token_ids: list[int]) -> ModelSpec:
    """A ModelSpec for a plain transformers model (generic path), for KV accounting."""
    config = model.config
    num_heads = getattr(config, "num_attention_heads", None) or config.n_head
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    param = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None \
        else config.vocab_size
    return ModelSpec(
        architecture=(config.architectures or [type(model).__name__])[0],
        num_layers=getattr(config, "num_hidden_layers", None) or config.n_layer,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim, vocab_size=vocab,
        max_position_embeddings=getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None) or 2048,
        dtype=param.dtype, device=param.device, eos_token_ids=list(eos_token_ids))


def _block_size(loaded, settings: Settings, spec: ModelSpec) -> int:
    size = getattr(loaded, "block_size", None)
    if size:
        return int(size)
    if getattr(loaded, "kind", "paged") == "paged":
        from opentgi.models.attention.selector import select_backend, select_block_size

        backend = getattr(loaded, "backend", None) or select_backend(torch.device(spec.device))
        return select_block_size(backend, settings.block_size)
    return settings.block_size or DEFAULT_CPU_BLOCK_SIZE


def eos_token_ids_of(loaded) -> list[int]:
    spec = getattr(loaded, "spec", None)
    ids = list(getattr(spec, "eos_token_ids", None) or [])
    if not ids:
        ids = list(getattr(loaded, "eos_token_ids", None) or [])
    if not ids:
        gen = getattr(getattr(loaded, "model", None), "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is not None:
            ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    tok_eos = getattr(loaded.tokenizer, "eos_token_id", None)
    if not ids and tok_eos is not None:
        ids = [tok_eos]
    return ids


def max_total_tokens_of(settings: Settings, spec: ModelSpec) -> int:
    return settings.max_total_tokens or min(spec.max_position_embeddings, 4096)


def _max_useful_tokens(settings: Settings, spec: ModelSpec) -> int:
    return settings.max_concurrent_requests * max_total_tokens_of(settings, spec)


def max_input_tokens_of(settings: Settings, spec: ModelSpec) -> int:
    max_total = max_total_tokens_of(settings, spec)
    return settings.max_input_tokens or min(spec.max_position_embeddings - 1, 4095, max_total - 1)


def max_batch_prefill_tokens_of(settings: Settings, spec: ModelSpec) -> int:
    return settings.max_batch_prefill_tokens or max_input_tokens_of(settings, spec) + 50


def largest_step(settings: Settings, spec: ModelSpec) -> StepShape:
    """The biggest step the scheduler can form: a full prefill budget (a chunk, or a whole prompt
    with chunking off) beside a decode row for every other sequence allowed to run."""
    prefill = max_batch_prefill_tokens_of(settings, spec)
    if settings.chunked_prefill_tokens is not None:
        prefill = max(1, min(settings.chunked_prefill_tokens, prefill))
    rows = settings.max_batch_size or settings.max_concurrent_requests * max(1, settings.max_best_of)
    return StepShape(prefill_tokens=prefill, decode_rows=max(0, rows - 1))


def _device_memory(spec: ModelSpec, memory: DeviceMemory | None) -> DeviceMemory | None:
    if memory is None and torch.device(spec.device).type == "cuda":
        return CudaMemory(torch.device(spec.device))
    return memory


def build_runner(loaded, settings: Settings, memory: DeviceMemory | None = None):
    """(runner, spec, num_blocks, block_size) for a LoadedModel. On CUDA (or with `memory` given)
    the KV pool is sized from device memory after profiling the largest step (gpu_memory.py)."""
    keep_freed_memory()
    kind = getattr(loaded, "kind", "paged")
    spec = getattr(loaded, "spec", None)
    if kind == "generic":
        from opentgi.engine.execution.generic_runner import GenericRunner

        if spec is None:
            spec = spec_from_hf_config(loaded.model, eos_token_ids_of(loaded))
        block_size = _block_size(loaded, settings, spec)
        runner = GenericRunner(loaded.model, spec.device, compute_score=getattr(loaded, "compute_score", None))
        memory = _device_memory(spec, memory)
        profile = None
        if memory is not None and settings.max_batch_total_tokens is None:
            free, total = memory.mem_get_info()  # transformers' own caches: no paged step to profile
            profile = MemoryProfile(free=free, total=total, step_peak=0)
        num_blocks = num_kv_blocks(settings, spec, block_size, _max_useful_tokens(settings, spec), profile)
        return runner, spec, num_blocks, block_size
    from opentgi.engine.execution.model_runner import ModelRunner

    spec = spec or loaded.model.spec
    spec.kv_cache_dtype = kv_cache_dtype(settings, spec)
    block_size = _block_size(loaded, settings, spec)
    memory = _device_memory(spec, memory)
    profile = None
    if memory is not None and settings.max_batch_total_tokens is None:
        profile = profile_step(lambda blocks: ModelRunner(loaded.model, num_blocks=blocks, block_size=block_size),
                               block_size, largest_step(settings, spec), memory)
    num_blocks = num_kv_blocks(settings, spec, block_size, _max_useful_tokens(settings, spec), profile)
    tp = getattr(loaded, "tp", None)
    if tp is not None and tp.world_size > 1:  # each rank sized its own pool: all use the smallest
        from opentgi.engine.execution.sharded_runner import ShardedModelRunner

        num_blocks = tp.min_over_ranks(num_blocks)
        return ShardedModelRunner(loaded.model, num_blocks, block_size, tp), spec, num_blocks, block_size
    return ModelRunner(loaded.model, num_blocks, block_size), spec, num_blocks, block_size


def speculate_tokens(settings: Settings, runner_kind: str) -> int:
    """--speculate N on the paged path (the generic path's HF caches cannot roll back drafts)."""
    n = settings.speculate or 0
    if n and runner_kind != "paged":
        log.warning("--speculate %d ignored: this model runs on the generic (transformers) path", n)
        return 0
    return n


def build_info(loaded, settings: Settings, spec: ModelSpec, num_blocks: int, block_size: int,
               runner_kind: str) -> EngineInfo:
    max_total = max_total_tokens_of(settings, spec)
    max_input = max_input_tokens_of(settings, spec)
    max_prefill = max_batch_prefill_tokens_of(settings, spec)
    tokenizer = loaded.tokenizer
    is_reward = bool(getattr(loaded, "is_reward_model", False)
                     or getattr(getattr(loaded, "model", None), "is_reward_model", False))
    return EngineInfo(
        model_id=str(getattr(loaded, "model_id", None) or settings.model_id or "unknown"),
        model_sha=getattr(loaded, "model_sha", None),
        model_dtype=str(spec.dtype),
        model_device_type=torch.device(spec.device).type,
        architecture=spec.architecture,
        pipeline_tag="text-classification" if is_reward else "text-generation",
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_total_tokens=num_blocks * block_size,
        max_batch_prefill_tokens=max_prefill,
        block_size=block_size,
        num_blocks=num_blocks,
        eos_token_ids=eos_token_ids_of(loaded),
        chat_template=getattr(loaded, "chat_template", None) or getattr(tokenizer, "chat_template", None),
        is_reward_model=is_reward,
        bos_token=getattr(tokenizer, "bos_token", None),
        eos_token=getattr(tokenizer, "eos_token", None),
        max_concurrent_requests=settings.max_concurrent_requests,
        max_best_of=settings.max_best_of,
        max_stop_sequences=settings.max_stop_sequences,
        max_top_n_tokens=settings.max_top_n_tokens,
        max_waiting_tokens=settings.max_waiting_tokens,
        max_batch_size=settings.max_batch_size,
        waiting_served_ratio=settings.waiting_served_ratio,
        chunked_prefill_tokens=settings.chunked_prefill_tokens,
        runner_kind=runner_kind,
        vocab_size=spec.vocab_size,
        adapters=list(getattr(loaded, "adapters", None) or []),
        speculate=speculate_tokens(settings, runner_kind),
        deterministic=batch_invariant(loaded),
        supported_architectures=list(PAGED_ARCHITECTURES),
        kernels=getattr(loaded, "kernels", "torch"),
        kv_cache_dtype=str(spec.cache_dtype).removeprefix("torch.") if runner_kind == "paged" else None,
    )


def batch_invariant(loaded) -> bool:
    """Whether a request's numbers do not depend on the rest of its batch (docs/determinism.md):
    the paged model built batch-invariant (the default on CPU; its LoRA adapters, if any, then take
    their row-invariant forms, models/lora/)."""
    return bool(getattr(getattr(loaded, "model", None), "batch_invariant", False))
