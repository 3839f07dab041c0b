"""Attaching the loaded adapters to a model (`attach_lora`, after `materialize`).

Every adapted projection (the fused `qkv_proj` and `gate_up_proj`, `o_proj`, `down_proj`, and the
other families' own) is wrapped in a `LoraLinear`. A routed-experts block's adapters are served
inside its grouped expert pass (models/layers/expert_lora.py, called from models/layers/moe.py):
per expert the adapters of its rows, each masked by its token's adapter; the router's LoRA is
added to its logits before the top k are chosen, so each token routes as its adapter does.

Tensor parallelism (`--num-shard`, models/parallel.py): each rank keeps only its slices of every
adapter (`ShardPlan.slice_lora`; the adapter file is read whole): A replicated and B sliced by the
rank's output rows on a column-parallel projection (q/k/v, gate/up, each expert's gate/up), A
sliced by its input columns and B replicated on a row-parallel one (o, down, each expert's down),
the router's whole. A row-parallel projection's `LoraLinear` sits inside its `RowParallel` (an
experts block's deltas inside the block), so the rank's partial delta is summed by the layer's one
all-reduce, and a bias (rank 0's) is added once. The step's per-row adapters travel to every rank
with the step (engine/execution/sharded_runner.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from opentgi.models.layers.adapter_lora import AdapterLora
from opentgi.models.layers.expert_lora import ExpertLora
from opentgi.models.lora.peft import LoraAdapter, LoraAdapterError
from opentgi.models.lora.projection import LoraLinear
from opentgi.models.lora.step import LoraState
from opentgi.models.lora.targets import GROUPS, OTHER_GROUPS, ROUTER, expert_of, module_shapes, shape_key
from opentgi.models.parallel import RowParallel


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
    model.lora_adapters = list(adapters)  # as loaded (unsliced): `replace_lora` attaches them again
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


def detach_lora(model) -> None:
    """Undo `attach_lora`: every `LoraLinear` back to its base projection, no experts' LoRA, no
    `model.lora`; the model is then as it was loaded."""
    for layer in model.model.layers:
        for attr, (owner, _) in [*GROUPS.items(), *OTHER_GROUPS.items()]:
            parent = getattr(layer, owner, None)
            current = getattr(parent, attr, None)
            if isinstance(current, RowParallel) and isinstance(current.linear, LoraLinear):
                current.linear = current.linear.base
            elif isinstance(current, LoraLinear):
                setattr(parent, attr, current.base)
        block = getattr(layer, "feed_forward", None)
        if getattr(block, "lora", None) is not None:
            block.lora = None
    model.lora = None
    model.lora_adapters = []


def replace_lora(model, adapters: list[LoraAdapter]) -> LoraState | None:
    """Serve exactly `adapters` from now on (adapters loaded or unloaded at run time): the model's
    LoRA is built again as `attach_lora` builds it at start, so an adapter added later is served
    exactly as one given at start in the same position."""
    detach_lora(model)
    return attach_lora(model, adapters)
