"""Reading Hugging Face checkpoints from a folder: safetensors (single or sharded with an index),
else PyTorch .bin files (loaded with weights_only)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn


def checkpoint_files(folder: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / shard for shard in shards]
    for pattern in ("model.safetensors", "*.safetensors", "pytorch_model.bin"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    raise FileNotFoundError(f"no safetensors or pytorch_model.bin weights in {folder}")


Renamer = Callable[[str], "str | None"]  # a stored name -> the model's, or None: not loaded


def _named(names, rename: Renamer | None):
    for stored in names:
        name = stored if rename is None else rename(stored)
        if name is not None:
            yield stored, name


def iter_checkpoint(folder: Path, rename: Renamer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every stored tensor; `rename` (models/checkpoints/text_tower.py) maps
    the stored names, None skipping a tensor unread."""
    for path in checkpoint_files(folder):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for stored, name in _named(f.keys(), rename):
                    yield name, f.get_tensor(stored)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for stored, name in _named(tensors.keys(), rename):
                yield name, tensors[stored]


def iter_checkpoint_sliced(folder: Path, shard, rename: Renamer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Like iter_checkpoint, but each tensor is `shard(name, shape, read)`, where `read(index)`
    reads only the indexed part (safetensors get_slice: the rest is never read)."""
    for path in checkpoint_files(folder):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for stored, name in _named(f.keys(), rename):
                    part = f.get_slice(stored)
                    yield name, shard(name, tuple(part.get_shape()), part.__getitem__)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for stored, name in _named(tensors.keys(), rename):
                yield name, shard(name, tuple(tensors[stored].shape), tensors[stored].__getitem__)


def load_weights(module: nn.Module, folder: Path, ignore_unexpected: tuple[str, ...] = (),
                 shard=None, observe: Callable[[str, torch.Tensor], None] | None = None,
                 rename: Renamer | None = None) -> None:
    """Copy every tensor of the checkpoint into the parameter of the same name (converting dtype
    and device). Fails on a missing parameter or a shape mismatch; checkpoint entries with no
    parameter are fine only when they end with one of `ignore_unexpected`. `shard` (tensor
    parallelism, models/parallel.py ShardPlan.slice) picks the part of each tensor to load;
    `observe(name, tensor)` sees each loaded tensor as the checkpoint holds it, before the copy
    converts its dtype. `rename`: as iter_checkpoint's. `folder` may also be a GGUFCheckpoint
    (gguf_checkpoint.py), whose tensors are read by its `iter_sliced`."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    if hasattr(folder, "iter_sliced"):  # a GGUFCheckpoint: each tensor dequantized from its blocks
        tensors = folder.iter_sliced(shard or (lambda name, shape, read: read(slice(None))))
    else:
        tensors = iter_checkpoint(folder, rename) if shard is None else iter_checkpoint_sliced(folder, shard, rename)
    with torch.no_grad():
        for name, tensor in tensors:
            param = params.get(name)
            if param is None:
                if name.endswith(ignore_unexpected) or name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(module).__name__}")
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                 f"shape {tuple(param.shape)}")
            if observe is not None:
                observe(name, tensor)
            param.copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
