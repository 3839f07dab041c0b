"""Loading a paged model's weights with quantized linears: from a GGUF file (gguf_checkpoint.py),
an AWQ / GPTQ checkpoint folder, or a float checkpoint quantized while loading (`--quantize`).

The linears that will hold a quantized weight are swapped for `QuantizedLinear` while the model is
still on the meta device, so no float copy of them is ever allocated; every other parameter is
allocated and copied as usual.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from opentgi.models.checkpoints.text_tower import tensor_renamer
from opentgi.models.checkpoints.weights import checkpoint_files, iter_checkpoint
from opentgi.models.quantization import awq_gptq, native_layouts, rtn
from opentgi.models.quantization.fp8 import FP8
from opentgi.models.quantization.gguf_blocks import GGUFEmbedding, activation_passes
from opentgi.models.quantization.linear import QuantizedLinear
from opentgi.models.quantization.methods import Quantize

# a layer's projections, a routed-experts block's experts' too (Qwen3-MoE's gate/up/down_proj,
# Mixtral's w1/w2/w3), not its router
_PROJECTION = re.compile(r"model\.layers\.\d+\.(?:(?:self_attn|mlp)\.\w+_proj"
                         r"|(?:mlp|block_sparse_moe)\.experts\.\d+\.(?:\w+_proj|w[123]))\.weight$")


class FolderWeights:
    """A Hugging Face checkpoint folder; AWQ / GPTQ 4-bit linears (config.json's
    `quantization_config`) come as Int4Groups."""

    def __init__(self, folder: Path, config):
        self.folder = folder
        qconfig = getattr(config, "quantization_config", None)
        if qconfig is not None and not isinstance(qconfig, dict):
            qconfig = qconfig.to_dict()
        self.method, self.group_size = awq_gptq.check_config(qconfig) if qconfig else (None, 0)
        self.zero_offset = 0 if str((qconfig or {}).get("checkpoint_format", "gptq")) == "gptq_v2" else 1
        self.rename = tensor_renamer(config)  # a multimodal checkpoint's text tower: its names

    def _names(self) -> list[str]:
        names: list[str] = []
        for path in checkpoint_files(self.folder):
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    names.extend(f.keys())
            else:
                names.extend(torch.load(path, map_location="cpu", weights_only=True, mmap=True).keys())
        if self.rename is not None:
            names = [n for n in map(self.rename, names) if n is not None]
        return names

    def int4_names(self) -> set[str]:
        if self.method is None:
            return set()
        return {name[: -len(".qweight")] + ".weight" for name in self._names() if name.endswith(".qweight")}

    def iter_tensors(self, int4_names: set[str]) -> Iterator[tuple[str, object]]:
        if self.method is None:
            yield from iter_checkpoint(self.folder, self.rename)
            return
        parts: dict[str, dict[str, torch.Tensor]] = {}
        wanted = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.method == "gptq" else set())
        for name, tensor in iter_checkpoint(self.folder, self.rename):
            prefix, _, leaf = name.rpartition(".")
            if prefix + ".weight" not in int4_names or leaf not in wanted | {"g_idx"}:
                yield name, tensor
                continue
            got = parts.setdefault(prefix, {})
            got[leaf] = tensor
            if wanted <= got.keys():
                yield prefix + ".weight", self._groups(parts.pop(prefix))
        if parts:
            raise ValueError(f"{self.method} linears lack some of qweight/qzeros/scales: {sorted(parts)[:3]}")

    def _groups(self, got: dict[str, torch.Tensor]):
        if self.method == "awq":
            return awq_gptq.awq_groups(got["qweight"], got["qzeros"], got["scales"], self.group_size)
        return awq_gptq.gptq_groups(got["qweight"], got["qzeros"], got["scales"], self.group_size,
                                    got.get("g_idx"), self.zero_offset)


def quantize_at_load(weight: torch.Tensor, quantize: Quantize, native_types: frozenset[int] = frozenset()):
    if quantize.method == "int8":
        blocks = native_layouts.in_native_layout(weight, native_types)
        return rtn.int8_rows(weight) if blocks is weight else blocks
    if quantize.method == "int4":
        return rtn.int4_groups(weight, quantize.group_size)
    return rtn.Fp8Rows(weight.detach().float())


def _swap_linears(model: nn.Module, names: set[str]) -> dict[str, QuantizedLinear]:
    """Replace the nn.Linear whose weight is named in `names` by a QuantizedLinear."""
    swapped: dict[str, QuantizedLinear] = {}
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{module_name}.{child_name}" if module_name else child_name
            if isinstance(child, nn.Linear) and f"{full}.weight" in names:
                linear = QuantizedLinear(child.in_features, child.out_features)
                setattr(module, child_name, linear)
                swapped[f"{full}.weight"] = linear
    return swapped


def load_quantized(model: nn.Module, weights, quantize: Quantize | None, dtype: torch.dtype,
                   device: torch.device, ignore_unexpected: tuple[str, ...] = (),
                   native_types: frozenset[int] = frozenset()) -> nn.Module:
    """`model` (on the meta device) with its weights from `weights` (FolderWeights or a
    GGUFCheckpoint): int4 linears of the checkpoint and, with an at-load `quantize`, every layer
    projection (in that format) become QuantizedLinear; the rest is allocated on `device` in
    `dtype` and copied."""
    if quantize is not None and quantize.method == "fp8" and FP8 is None:
        raise ValueError("--quantize fp8: this torch build has no float8 type")
    int4 = weights.int4_names()
    names = set(int4)
    if quantize is not None and quantize.at_load:  # every layer projection in the asked format
        projections = {name for name, _ in model.named_parameters() if _PROJECTION.match(name)}
        int4 -= projections  # a GGUF's 4-bit ones too: dequantized, then quantized again
        names |= projections
    quantized = _swap_linears(model, names)
    embedding = weights.embedding_blocks() if hasattr(weights, "embedding_blocks") and \
        hasattr(getattr(model, "model", None), "embed_tokens") else None
    if embedding is not None:  # looked up in the file's blocks (GGUF, native kernels): no dense copy
        model.model.embed_tokens = GGUFEmbedding(embedding, dtype)
    model = model.to(dtype).to_empty(device=device)  # allocated in dtype at once
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    cache = getattr(weights, "packed_cache", None) if device.type == "cpu" and int4 & quantized.keys() else None
    cached = {name: fmt for name, fmt in (cache.load() if cache else {}).items() if name in int4 & quantized.keys()}
    for name, fmt in cached.items():
        quantized[name].weight_format = fmt
        loaded.add(name)
    skip = set(cached) | ({"model.embed_tokens.weight"} if embedding is not None else set())
    tensors = weights.iter_tensors(int4 & quantized.keys(), skip=skip) if skip else \
        weights.iter_tensors(int4 & quantized.keys())
    with torch.no_grad():
        for name, value in tensors:
            # a GGUF's dense tensor (DenseTensor) goes into a weight a chunk of rows at a time
            # (`copy_into`), and comes whole where it is quantized or is a bias
            if hasattr(value, "copy_into") and not (name in params and name not in quantized):
                value = value.tensor()
            if name in quantized:
                linear = quantized[name]
                if isinstance(value, torch.Tensor):
                    value = quantize_at_load(value, quantize, native_types)
                value = native_layouts.in_native_layout(value, native_types)
                if tuple(value.shape) != (linear.out_features, linear.in_features):
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape "
                                     f"{(linear.out_features, linear.in_features)}")
                linear.weight_format = value.to_format(dtype, device)
                if hasattr(linear.weight_format, "passes"):  # GGML blocks on the native kernels
                    linear.weight_format.passes = activation_passes(name)
                loaded.add(name)
            elif name.endswith(".bias") and name[:-5] + ".weight" in quantized:
                quantized[name[:-5] + ".weight"].bias = value.to(device=device, dtype=dtype)
            elif name in params:
                if params[name].shape != value.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model "
                                     f"shape {tuple(params[name].shape)}")
                if hasattr(value, "copy_into"):
                    value.copy_into(params[name])
                else:
                    params[name].copy_(value)
                loaded.add(name)
            elif not (name.endswith(ignore_unexpected) or name.endswith("rotary_emb.inv_freq")):
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
    tied = weights.tied_head_blocks() if getattr(model, "tie_word_embeddings", False) and \
        hasattr(weights, "tied_head_blocks") else None
    if tied is not None:  # a tied head multiplied by the embedding's own blocks (gguf_checkpoint.py)
        model.native_head = QuantizedLinear(tied.shape[1], tied.shape[0])
        model.native_head.weight_format = tied.to_format(dtype, device)
    missing = sorted((set(params) | set(quantized)) - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if cache is not None and not cached:
        cache.save({name: quantized[name].weight_format for name in int4 & quantized.keys()})
    return model
