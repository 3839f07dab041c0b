"""LoRA adapters on the paged decoder (q/k/v/o and the dense MLP's gate/up/down of every family;
Phi-3's checkpoint-fused qkv_proj/gate_up_proj and StarCoder2's c_fc/c_proj; a mixture-of-experts
block's experts and router): PEFT checkpoints loaded at start-up, many adapters served in one batch.

Loading (`load_adapters`): each adapter is a PEFT folder (`adapter_config.json` +
`adapter_model.safetensors`) with its own rank and alpha, on any subset of the q/k/v/o/gate/up/down
projections, of the experts' projections (`mlp.experts.E.gate_proj/up_proj/down_proj` in Qwen3-MoE,
`block_sparse_moe.experts.E.w1/w3/w2` in Mixtral, as PEFT names them) and of the routers
(`mlp.gate`, `block_sparse_moe.gate`: nn.Linear layers PEFT adapts). Anything this code cannot apply
exactly (DoRA, `modules_to_save`, LoRA biases, rank or alpha patterns, embeddings, a shape that does
not fit the base model, experts of a dense layer or under the other family's names) stops start-up
with a message saying which adapter and why.

Serving (`attach_lora`): every adapted projection of the model (the fused `qkv_proj` and
`gate_up_proj`, `o_proj`, `down_proj`) is wrapped in a `LoraLinear`. With a batch-invariant model
(the default, docs/determinism.md) it holds one `AdapterLora` per adapter (models/layers/adapter_lora.py,
shared with the experts' LoRA): the adapter's A of every fused part as one shrink matrix and its
scaled B as one block-diagonal expand matrix, at its own rank, in float32. A step computes, for
each adapter its rows use, on those rows only (gathered, unless they are all the step's),

    y[rows] = y[rows] + (x[rows] @ shrink) @ expand       (float32 `torch.mm`, rounded once into y)

Each matmul multiplies at least the row count measured at start-up to give every row the same
bits (`invariant_min_rows`; fewer rows are zero-padded), so a row's result depends on its own
input and adapter only: not on the step's other rows, their adapters, the row count or its
position; a base row is never touched, keeping the bits of a step without adapters. A step pays
for the adapters its rows use, not for every one loaded.

With `--nondeterministic` the stacked form is kept: per layer and projection the A matrices of
all adapters are stacked into one shrink matrix [in, parts*slots*R] and the B matrices (scaled by
alpha/r) into one expand matrix [slots*R, out] per fused part, ranks zero-padded to the largest R,
in the model's dtype, over every token of the step:

    y = base(x) + ((x @ shrink) * mask) @ expand        (per part, into that part's columns)

where `mask` keeps, for each token, only the columns of its row's adapter (built once per step and
shared by every layer), and only the adapters the step uses are stacked in (`index_select`). Its
row's delta can depend on the step's row count and adapters (seen in float32 at ranks 4 to 128,
in bfloat16 at rank 128 over 1536 inputs: tests/engine/test_determinism_lora.py). Both are punica's BGMV (a gathered A/B per row) done
as dense matmuls: `bench/runner.py --lora` measures them against the per-token gather
(`bgmv_delta`, kept as the reference the tests compare against). A step where no row uses an
adapter, or a server without adapters, does no LoRA work at all.

A routed-experts block's adapters (`_attach_expert_lora`) are served inside its grouped expert pass
(models/layers/expert_lora.py, called from models/layers/moe.py): per expert the adapters of its
rows, `AdapterLora`s again, on the rows the expert takes, each masked by its token's adapter; the
router's LoRA is added to its logits before the top k are chosen, so each token routes as its
adapter does.

Tensor parallelism (`--num-shard`, models/parallel.py): each rank keeps only its slices of every
adapter (`ShardPlan.slice_lora`; the adapter file is read whole, a few MB, as TGI and vLLM read
it): A replicated and B sliced by the rank's output rows on a column-parallel projection (q/k/v,
gate/up, fused or not, each expert's gate/up), A sliced by its input columns and B replicated on a
row-parallel one (o, down, each expert's down), the router's whole. A row-parallel projection's
`LoraLinear` sits inside its `RowParallel` (an experts block's deltas inside the block), so the
rank's partial delta is summed by the layer's one all-reduce, and a bias (rank 0's) is added once.
The step's per-row adapters travel to every rank with the step (engine/execution/sharded_runner.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.layers.adapter_lora import AdapterLora
from opentgi.models.layers.expert_lora import ExpertLora
from opentgi.models.parallel import RowParallel

log = logging.getLogger(__name__)

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's (fused) projections and the PEFT modules each one holds, in output order.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
# Other families' projections, each its own PEFT module: Phi-3's checkpoint-fused q/k/v and
# gate/up, StarCoder2's MLP.
OTHER_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("qkv_proj",)),
    "gate_up_proj": ("mlp", ("gate_up_proj",)),
    "c_fc": ("mlp", ("c_fc",)),
    "c_proj": ("mlp", ("c_proj",)),
}
# A routed-experts block's (`mlp` in Qwen3-MoE, `block_sparse_moe` in Mixtral): each expert's
# projections (`experts.E.<name>`, Mixtral's w1/w3/w2 = gate/up/down) and the router (`gate`).
EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")
ROUTER = "gate"
ACCEPTED_MODULES = TARGET_MODULES + ("qkv_proj", "gate_up_proj", "c_fc", "c_proj", "w1", "w3", "w2", ROUTER)
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


def shape_key(module: str) -> str:
    """`experts.3.w1` -> `experts.w1` (every expert's projection has one shape); others as they are."""
    return f"experts.{module.rsplit('.', 1)[1]}" if module.startswith("experts.") else module


def expert_of(module: str) -> int | None:
    """The expert index of an `experts.E.<name>` module, else None."""
    return int(module.split(".")[1]) if module.startswith("experts.") else None


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


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT target module of a Llama-family config (an expert's by `shape_key`)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    expert = getattr(config, "moe_intermediate_size", None) or inter
    experts = {f"experts.{m}": (expert, hidden) if m in ("down_proj", "w2") else (hidden, expert)
               for m in EXPERT_MODULES}
    return {**experts, ROUTER: (hidden, num_experts(config)),
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden), "qkv_proj": (hidden, heads * head_dim + 2 * kv),
            "gate_up_proj": (hidden, 2 * inter), "c_fc": (hidden, inter), "c_proj": (inter, hidden)}


def num_experts(config) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


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


# --- the batched delta ----------------------------------------------------------------------------


def bgmv_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Punica's BGMV in plain torch: every token gathers its adapter's A [R, in] and B [R, out]
    (a [S, R, in], b [S, R, out]; slot -1 = no adapter). The per-row reference of `LoraLinear`."""
    used = token_slots >= 0
    out = x.new_zeros(x.shape[0], b.shape[-1])
    if used.any():
        rows = used.nonzero().squeeze(1)
        slots = token_slots[rows]
        shrunk = torch.bmm(x[rows].unsqueeze(1), a[slots].transpose(1, 2))  # [n, 1, R]
        out[rows] = torch.bmm(shrunk, b[slots]).squeeze(1)
    return out


class LoraStep:
    """One step's adapter assignment: the slots it uses and, per token, the mask of its slot."""

    def __init__(self, token_slots: torch.Tensor, used_slots: list[int], num_slots: int, rank: int, dtype,
                 one_slot: bool = False):
        self.token_slots = token_slots
        self.all_slots = len(used_slots) == num_slots
        self.num_used = len(used_slots)
        self.used = torch.tensor(used_slots, device=token_slots.device)
        self.used_key = tuple(used_slots)
        self.one_slot = one_slot  # every token of the step uses the one adapter used
        self.rank, self.dtype = rank, dtype
        self._slot_mask: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}
        self._token_masks: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor | None] = {}
        self._adapter_tokens: torch.Tensor | None = None

    def rows_of(self, slot: int) -> torch.Tensor | None:
        """The indices of the tokens of adapter `slot`; None when every token of the step is one."""
        if self.one_slot:
            return None
        found = self._rows.get(slot)
        if found is None:
            found = self._rows[slot] = (self.token_slots == slot).nonzero().squeeze(1)
        return found

    def token_mask(self, slot: int) -> torch.Tensor:
        """[T, 1] float32: 1 for the tokens of adapter `slot` (the experts' LoRA,
        models/layers/expert_lora.py)."""
        found = self._token_masks.get(slot)
        if found is None:
            found = self._token_masks[slot] = (self.token_slots == slot).float().unsqueeze(1)
        return found

    def adapter_tokens(self) -> torch.Tensor:
        """[T] bool: the tokens whose row uses an adapter."""
        if self._adapter_tokens is None:
            self._adapter_tokens = self.token_slots >= 0
        return self._adapter_tokens

    def mask(self, parts: int) -> torch.Tensor:
        """[T, parts*used*R], columns (part, slot, r): 1 where the slot is the token's adapter."""
        found = self._masks.get(parts)
        if found is None:
            if self._slot_mask is None:
                onehot = (self.token_slots.unsqueeze(1) == self.used.unsqueeze(0)).to(self.dtype)  # [T, used]
                self._slot_mask = onehot.repeat_interleave(self.rank, dim=1)  # [T, used*R]: columns (slot, r)
            found = self._masks[parts] = self._slot_mask.repeat(1, parts)
        return found


class LoraState:
    """Shared by every LoraLinear of a model: the adapters' slots and the current step."""

    def __init__(self, names: list[str], rank: int, dtype: torch.dtype, device: torch.device):
        self.names = names
        self.slot_of = {name: i for i, name in enumerate(names)}
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.step: LoraStep | None = None

    def slots_of(self, adapter_ids: list[str | None]) -> list[int]:
        """Rows' adapters (None = base) -> their slots (-1 = base)."""
        return [-1 if a is None else self.slot_of[a] for a in adapter_ids]

    def begin_step(self, adapter_ids: list[str | None], num_new_tokens: list[int]) -> None:
        """Rows' adapters (None = base) and token counts, in the varlen order of the step."""
        self.begin_step_slots(self.slots_of(adapter_ids), num_new_tokens)

    def begin_step_slots(self, slots: list[int], num_new_tokens: list[int]) -> None:
        """As `begin_step`, the rows' adapters given by slot (-1 = base): how a tensor-parallel
        rank gets them from the driver."""
        used = sorted({s for s in slots if s >= 0})
        if not used:
            self.step = None
            return
        token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                              torch.tensor(num_new_tokens, dtype=torch.int64)).to(self.device)
        self.step = LoraStep(token_slots, used, len(self.names), self.rank, self.dtype,
                             one_slot=len(set(slots)) == 1)

    def end_step(self) -> None:
        self.step = None


class LoraLinear(ForwardWithoutHooks, nn.Module):
    """A projection (one or several fused parts, e.g. q/k/v) with the LoRA matrices of every adapter:
    base(x) plus, for the tokens of rows using an adapter, that adapter's scaled B(A(x)).

    a: [slots, parts, R, in]; b: per part [slots, R, out_p] (already scaled; zero rows pad smaller
    ranks, zero matrices stand for parts an adapter does not adapt).

    `row_invariant` (the default with a batch-invariant model): one `AdapterLora` per adapter, at its
    own rank (`ranks`), in float32 row-invariant matmuls (models/layers/adapter_lora.py); each
    adapter's delta is computed on its own rows only (gathered unless they are all the step's) and
    added into them, so a row's bits do not depend on the other rows, and a base row is never
    touched. Otherwise (--nondeterministic) the stacked form: shrink [in, parts*slots*R] (columns
    (part, slot, r), transposed: measured 1.7x faster than multiplying by A.T on CPU) and one expand
    [slots*R, out_p] per part in the model's dtype, over every token of the step, masked."""

    def __init__(self, base: nn.Module, state: LoraState, a: torch.Tensor, b: list[torch.Tensor],
                 row_invariant: bool = False, ranks: list[int] | None = None):
        super().__init__()
        self.base = base
        self.state = state
        self.num_slots, self.parts, self.rank, fan_in = a.shape
        self.out_sizes = [part.shape[-1] for part in b]
        self.adapters: list[AdapterLora | None] | None = None
        if row_invariant:
            ranks = ranks or [self.rank] * self.num_slots
            self.adapters = [AdapterLora(a[s, :, :r], [part[s, :r] for part in b]) if a[s].any() else None
                             for s, r in enumerate(ranks)]
            self.per_adapter = nn.ModuleList([m for m in self.adapters if m is not None])  # for .modules()
            for module in self.per_adapter:
                module.make_row_invariant()
            return
        a, b = a.to(state.dtype), [part.to(state.dtype) for part in b]
        self.shrink = a.permute(3, 1, 0, 2).reshape(fan_in, -1).contiguous()
        self.expand = [part.reshape(-1, part.shape[-1]).contiguous() for part in b]
        self._subset_cache: tuple | None = None  # (used slots, shrink, expand) of the last subset

    def _subset(self, step: LoraStep) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stacked matrices of the step's adapters only; kept while consecutive steps use the
        same ones (decode steps mostly do)."""
        cached = self._subset_cache
        if cached is not None and cached[0] == step.used_key:
            return cached[1], cached[2]
        shrink = self.shrink.view(-1, self.parts, self.num_slots, self.rank).index_select(2, step.used)
        shrink = shrink.reshape(shrink.shape[0], -1)
        expand = [e.view(self.num_slots, self.rank, -1).index_select(0, step.used).flatten(0, 1)
                  for e in self.expand]
        self._subset_cache = (step.used_key, shrink, expand)
        return shrink, expand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.state.step
        if step is None:
            return y
        if self.adapters is not None:
            return self._add_per_adapter(x, y, step)
        shrink, expand = self.shrink, self.expand
        if not step.all_slots:  # only the adapters this step uses
            shrink, expand = self._subset(step)
        h = torch.mm(x, shrink).mul_(step.mask(self.parts))
        if self.parts == 1:
            return y.addmm_(h, expand[0])
        width = step.num_used * self.rank
        col = 0
        for p, size in enumerate(self.out_sizes):
            y[:, col:col + size].addmm_(h[:, p * width:(p + 1) * width], expand[p])
            col += size
        return y

    def _add_per_adapter(self, x: torch.Tensor, y: torch.Tensor, step: LoraStep) -> torch.Tensor:
        """y's rows of each adapter the step uses plus that adapter's float32 delta (rounded once,
        into y's dtype)."""
        for slot in step.used_key:
            lora = self.adapters[slot]
            if lora is None:
                continue
            rows = step.rows_of(slot)
            if rows is None:  # every token of the step is this adapter's
                y.add_(lora(x))
            else:
                own = y.index_select(0, rows).float().add_(lora(x.index_select(0, rows)))
                y.index_copy_(0, rows, own.to(y.dtype))
        return y


def _stack(adapters: list[LoraAdapter], layer: int, modules: tuple[str, ...], shapes, rank: int,
           dtype, device) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """A [slots, parts, R, in] and B per part [slots, R, out_p] (scaled) of one projection group, or
    None when no adapter touches it."""
    if not any((layer, m) in ad.weights for ad in adapters for m in modules):
        return None
    fan_in = shapes[shape_key(modules[0])][0]
    a_all = torch.zeros(len(adapters), len(modules), rank, fan_in, dtype=torch.float32)
    b_all = [torch.zeros(len(adapters), rank, shapes[shape_key(m)][1], dtype=torch.float32) for m in modules]
    for s, adapter in enumerate(adapters):
        for p, module in enumerate(modules):
            pair = adapter.weights.get((layer, module))
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                a_all[s, p, :r] = a.float()
                b_all[p][s, :r] = (b.float() * adapter.scaling).t()
    return (a_all.to(device=device, dtype=dtype), [b.to(device=device, dtype=dtype) for b in b_all])


def attach_lora(model, adapters: list[LoraAdapter]) -> LoraState | None:
    """Wrap the model's adapted projections (after `materialize`) and set `model.lora`; with no
    adapters the model is left exactly as it was."""
    if not adapters:
        return None
    plan = getattr(model, "shard_plan", None)  # models/parallel.py: this rank's slices only
    if plan is not None:
        adapters = [_sliced(adapter, plan) for adapter in adapters]
    spec = model.spec
    rank = max(a.rank for a in adapters)
    state = LoraState([a.name for a in adapters], rank, spec.dtype, torch.device(spec.device))
    shapes = module_shapes(model.config)
    row_invariant = bool(getattr(model, "batch_invariant", False))
    ranks = [a.rank for a in adapters]
    for i, layer in enumerate(model.model.layers):
        for attr, (owner, modules) in [*GROUPS.items(), *OTHER_GROUPS.items()]:
            stacked = _stack(adapters, i, modules, shapes, rank, torch.float32, spec.device)
            if stacked is None:
                continue
            parent = getattr(layer, owner, None)  # Mixtral's layers have block_sparse_moe, no mlp
            if not isinstance(getattr(parent, attr, None), nn.Module):
                raise LoraAdapterError(f"adapter targets {'/'.join(modules)} of layer {i}, which "
                                       f"{model.spec.architecture} does not have")
            base = getattr(parent, attr)
            if isinstance(base, RowParallel):  # the delta joins the partial product before the all-reduce
                base.linear = LoraLinear(base.linear, state, *stacked, row_invariant, ranks)
            else:
                setattr(parent, attr, LoraLinear(base, state, *stacked, row_invariant, ranks))
        _attach_expert_lora(model, i, layer, adapters, state, shapes)
    model.lora = state
    return state


def _sliced(adapter: LoraAdapter, plan) -> LoraAdapter:
    """The adapter's matrices this tensor-parallel rank holds (models/parallel.py `slice_lora`)."""
    weights = {(layer, module): plan.slice_lora(f"model.layers.{layer}.{module}.weight", a, b)
               for (layer, module), (a, b) in adapter.weights.items()}
    return dataclasses.replace(adapter, weights=weights)


def _attach_expert_lora(model, i: int, layer, adapters: list[LoraAdapter], state: LoraState, shapes) -> None:
    """The experts' and the router's LoRA of layer i's routed-experts block, if any adapter has some."""
    wanted = sorted({m for ad in adapters for (n, m) in ad.weights if n == i and (expert_of(m) is not None
                                                                                 or m == ROUTER)})
    if not wanted:
        return
    spec = model.spec
    block = getattr(layer, "feed_forward", None)
    if not hasattr(block, "experts"):
        raise LoraAdapterError(f"adapter targets {'/'.join(sorted({shape_key(m) for m in wanted}))} of layer {i}, "
                               f"which {spec.architecture} does not have (its feed-forward block there has "
                               "no experts)")
    gate, up, down = block.experts[0].names  # the checkpoint's names (Mixtral's: w1, w3, w2)
    foreign = sorted({shape_key(m) for m in wanted if m != ROUTER} - {f"experts.{n}" for n in (gate, up, down)})
    if foreign:
        raise LoraAdapterError(f"adapter targets {'/'.join(foreign)} of layer {i}, which {spec.architecture} "
                               f"does not have (its experts' projections are {gate}/{up}/{down})")

    def single(adapter: LoraAdapter, modules: tuple[str, ...]) -> AdapterLora | None:
        found = _stack([adapter], i, modules, shapes, adapter.rank, torch.float32, spec.device)
        return None if found is None else AdapterLora(found[0][0], [b[0] for b in found[1]])

    experts = range(len(block.experts))
    lora = ExpertLora(state, [single(ad, (ROUTER,)) for ad in adapters],
                      [[single(ad, (f"experts.{e}.{gate}", f"experts.{e}.{up}")) for ad in adapters] for e in experts],
                      [[single(ad, (f"experts.{e}.{down}",)) for ad in adapters] for e in experts])
    if getattr(model, "batch_invariant", False):
        lora.make_row_invariant()
    block.lora = lora
