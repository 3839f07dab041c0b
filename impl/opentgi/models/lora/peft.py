"""Reading PEFT adapters at start-up (`load_adapters`).

Each adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) with its own
rank and alpha, on any subset of the projections of `targets.py`. Anything this code cannot apply
exactly (DoRA, `modules_to_save`, LoRA biases, rank or alpha patterns, embeddings, a shape that does
not fit the base model, experts of a dense layer or under the other family's names) stops start-up
with a message saying which adapter and why. Nothing is downloaded: an adapter is a local folder
or a hub id already in the local Hugging Face cache.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opentgi.models.lora.targets import (
    ACCEPTED_MODULES,
    EXPERT_MODULES,
    ROUTER,
    expert_of,
    module_shapes,
    num_experts,
    shape_key,
)

log = logging.getLogger(__name__)

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.((?:experts\.\d+\.)?\w+)"
                  r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoraAdapterError(ValueError):
    """An adapter cannot be loaded or applied; the message names it and says why."""


@dataclass
class LoraAdapter:
    name: str
    folder: Path
    rank: int
    alpha: float
    scaling: float
    base_model: str | None
    # (layer, module) -> (A [r, in], B [out, r]) as in the checkpoint (B not yet scaled)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        """The adapted modules, experts' as `experts.<name>`."""
        names = {shape_key(module) for _, module in self.weights}
        return sorted(names, key=lambda m: (m.startswith("experts."), ACCEPTED_MODULES.index(m.split(".")[-1])))


def _known_module(owner: str, module: str) -> bool:
    """Whether `<owner>.<module>` of a layer is something this code applies LoRA to."""
    if module.startswith("experts."):
        return owner != "self_attn" and module.rsplit(".", 1)[1] in EXPERT_MODULES
    if owner == "block_sparse_moe":
        return module == ROUTER
    return module in ACCEPTED_MODULES and module not in ("w1", "w3", "w2")


# --- naming and finding adapters ------------------------------------------------------------------


def parse_adapter_list(text: str | list[str] | None) -> list[tuple[str, str]]:
    """`--lora-adapters` (comma-separated `id` or `name=path`) -> [(name, source)], in order."""
    items = text if isinstance(text, list) else (text or "").split(",")
    out: list[tuple[str, str]] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, sep, source = item.partition("=")
        name, source = (name.strip(), source.strip()) if sep else (item, item)
        if not name or not source:
            raise LoraAdapterError(f"--lora-adapters entry {item!r}: expected an id, a folder or name=path")
        if any(name == seen for seen, _ in out):
            raise LoraAdapterError(f"--lora-adapters names adapter {name!r} twice")
        out.append((name, source))
    return out


def resolve_adapter_folder(name: str, source: str) -> Path:
    """A local folder, else a hub id already in the local Hugging Face cache (nothing is downloaded)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise LoraAdapterError(f"adapter {name!r}: {source!r} is a file; give the adapter's folder "
                               "(adapter_config.json + adapter_model.safetensors)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a valid repo id, or not cached: one clear message below
        raise LoraAdapterError(
            f"adapter {name!r}: {source!r} is not a local folder and not in the local Hugging Face "
            f"cache (adapters are never downloaded at start-up). Download it first "
            f"(`huggingface-cli download {source}`) or pass name=/path/to/adapter") from None


# --- reading PEFT checkpoints ---------------------------------------------------------------------


def _check_config(name: str, config: dict) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraAdapterError(f"adapter {name!r} is a {peft_type} adapter; only LoRA is supported")
    refusals = [
        (config.get("use_dora"), "uses DoRA (use_dora)"),
        (config.get("modules_to_save"), f"trains whole modules too (modules_to_save={config.get('modules_to_save')})"),
        (config.get("bias", "none") not in ("none", None), f"trains biases (bias={config.get('bias')!r})"),
        (config.get("rank_pattern"), "has per-module ranks (rank_pattern)"),
        (config.get("alpha_pattern"), "has per-module alphas (alpha_pattern)"),
        (config.get("fan_in_fan_out"), "stores weights transposed (fan_in_fan_out)"),
        (config.get("layer_replication"), "replicates layers (layer_replication)"),
        (config.get("target_parameters"),
         f"adapts parameters directly (target_parameters={config.get('target_parameters')})"),
    ]
    for bad, why in refusals:
        if bad:
            raise LoraAdapterError(f"adapter {name!r} {why}: not supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unsupported = sorted(set(targets) - set(ACCEPTED_MODULES))
        if unsupported:
            raise LoraAdapterError(f"adapter {name!r} targets {unsupported}: only {list(ACCEPTED_MODULES)} "
                                   "can carry LoRA here")


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        other = " (only adapter_model.bin: convert it to safetensors)" if (folder / "adapter_model.bin").exists() else ""
        raise LoraAdapterError(f"adapter {name!r}: {folder} has no adapter_model.safetensors{other}")
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        raise LoraAdapterError(f"adapter {name!r}: cannot read {path}: {exc}") from None


def load_peft_adapter(name: str, folder: Path) -> LoraAdapter:
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise LoraAdapterError(f"adapter {name!r}: {folder} has no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"adapter {name!r}: cannot read {config_path}: {exc}") from None
    _check_config(name, config)
    try:
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError):
        raise LoraAdapterError(f"adapter {name!r}: adapter_config.json lacks a valid rank `r`") from None
    if rank < 1:
        raise LoraAdapterError(f"adapter {name!r}: rank r={rank} must be at least 1")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoraAdapter(name=name, folder=folder, rank=rank, alpha=alpha, scaling=scaling,
                          base_model=config.get("base_model_name_or_path"))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(name, folder).items():
        match = _KEY.search(key)
        if match is None or not _known_module(match.group(2), match.group(3)):
            raise LoraAdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B matrix of one of "
                                   f"{list(ACCEPTED_MODULES)} (an expert's too): not supported")
        layer, _, module, half = match.groups()
        halves.setdefault((int(layer), module), {})[half] = tensor
    if not halves:
        raise LoraAdapterError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} "
                                   "without its other half")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraAdapterError(f"adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and "
                                   f"lora_B {tuple(b.shape)} are not [r, in] and [out, r]")
        if a.shape[0] != rank:
            raise LoraAdapterError(f"adapter {name!r}: layer {layer} {module} has rank {a.shape[0]}, "
                                   f"adapter_config.json says r={rank}")
        adapter.weights[(layer, module)] = (a, b)
    return adapter


def check_fits(adapter: LoraAdapter, config, model_id: str) -> None:
    """Every matrix must fit the base model's layer count and projection shapes."""
    shapes = module_shapes(config)
    other = adapter.base_model and adapter.base_model != model_id
    trained_for = f" (trained for {adapter.base_model!r})" if other else ""
    for (layer, module), (a, b) in adapter.weights.items():
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(f"adapter {adapter.name!r} does not fit base model {model_id!r}{trained_for}: "
                                   f"it adapts layer {layer}, the model has {config.num_hidden_layers} layers")
        expert = expert_of(module)
        if expert is not None and expert >= num_experts(config):
            raise LoraAdapterError(f"adapter {adapter.name!r} does not fit base model {model_id!r}{trained_for}: "
                                   f"it adapts expert {expert} of layer {layer}, the model has "
                                   f"{num_experts(config)} experts")
        fan_in, fan_out = shapes[shape_key(module)]
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoraAdapterError(
                f"adapter {adapter.name!r} does not fit base model {model_id!r}{trained_for}: layer {layer} "
                f"{module} maps {a.shape[1]} -> {b.shape[0]} features, the model's maps {fan_in} -> {fan_out}")
    if other:
        log.info("adapter %r was trained on %r; its shapes fit %r", adapter.name, adapter.base_model, model_id)


def load_adapters(spec: str | list[str] | None, config, model_id: str) -> list[LoraAdapter]:
    adapters = []
    for name, source in parse_adapter_list(spec):
        if name == model_id:
            raise LoraAdapterError(f"adapter name {name!r} is the base model's id, which selects the base model")
        adapter = load_peft_adapter(name, resolve_adapter_folder(name, source))
        check_fits(adapter, config, model_id)
        log.info("LoRA adapter %r: rank %d, alpha %g, %s", name, adapter.rank, adapter.alpha,
                 "/".join(adapter.target_modules))
        adapters.append(adapter)
    return adapters
