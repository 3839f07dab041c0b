"""The one place that picks the attention backend and the KV block size for a device."""

from __future__ import annotations

import importlib.util
import logging

import torch

from opentgi.models.attention.backend import AttentionBackend

log = logging.getLogger(__name__)

CPU_BLOCK_SIZE = 16
FLASH_BLOCK_SIZE = 256  # flash-attn's paged kernels need a multiple of 256


def flash_attn_available(device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """flash-attn runs on CUDA in float16/bfloat16 only."""
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return False
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def select_backend(device: torch.device, dtype: torch.dtype | None = None,
                   kernels: str = "torch") -> AttentionBackend:
    """flash-attn on CUDA when it is installed (and the dtype is 16-bit); on CPU, with `kernels`
    (`--kernels`) auto or native, the native backend (decode rows in one native kernel call per
    layer: native_backend.py) where the native kernels build and load (auto: else the torch
    backend, with a warning; native: else KernelsUnavailable); else the torch backend."""
    if flash_attn_available(device, dtype):
        from opentgi.models.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend()
    if device.type == "cpu" and kernels != "torch":
        from opentgi.kernels import native

        path = native.load(kernels)  # KernelsUnavailable with --kernels native and no library
        if path.name == "native":
            from opentgi.models.attention.native_backend import NativeAttentionBackend

            return NativeAttentionBackend()
        log.warning("attention: the torch backend serves decode rows (%s)", path.reason)
    from opentgi.models.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def select_block_size(backend: AttentionBackend, requested: int | None) -> int:
    """Settings.block_size when given (checked against the backend), else the backend's choice."""
    if backend.name == "flash-attn":
        if requested is None:
            return FLASH_BLOCK_SIZE
        if requested % FLASH_BLOCK_SIZE:
            raise ValueError(f"block size {requested} is not supported by flash-attn's paged "
                             f"attention: use a multiple of {FLASH_BLOCK_SIZE}")
        return requested
    if requested is not None and requested < 1:
        raise ValueError(f"block size must be positive, got {requested}")
    return requested or CPU_BLOCK_SIZE
