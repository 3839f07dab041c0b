"""A sparse mixture-of-experts block (Mixtral, Qwen3-MoE) in one grouped pass.

Routing as the checkpoints' own code does it: the router's logits (in the model dtype), softmax
in float32, the top k experts per token, their weights renormalised to sum to one (Mixtral always;
Qwen3-MoE when `norm_topk_prob`), cast back to the model dtype (computed as the softmax of the
top k logits: the same numbers). The tiny router's logits are one elementwise product and one
float32 reduction a row (`RouterLogits`), rounded to the model dtype as a linear layer rounds them.

The step's (token, expert) pairs are then sorted by expert (one stable argsort), the expert counts
read once, and every expert the step uses runs its gate/up projection over its contiguous slice of
the sorted rows, the activation once over all of them, then each expert's down projection; the
weighted outputs are scatter-added back to their tokens (`index_add_`). The Python loop is over
the experts a step uses, never over tokens. A lone token skips the sort and the scatter: its k
experts' weighted outputs are summed as `index_add_` sums them (in expert order).

A token's result does not depend on the step's other tokens (docs/determinism.md) when each
expert's linears are row invariant (models/layers/linear.py): routing is per token, the activation
elementwise, and `index_add_` sums a token's k contributions alone, in expert order.

Where every expert's projections are GGML blocks on the native kernels (a GGUF's, or `--quantize`'s
native layouts) the experts run grouped instead (`GroupedExperts`): one native call for every
token's gate/up projections by its k experts, the activation once, one call for the down
projections and the weighted sum (opentgi.kernels.native's moe_up, moe_down): no Python loop over
experts, each token's row quantized once for its k experts, and the same bits the per-expert path
gives (float32: the products, their rounding and the sum in expert order are the same arithmetic).

Dense experts (bias-free float32, float16 or bfloat16 linears) join that path where the native
kernels serve the model: `fuse_projections` puts each on the kernels' dense rows
(`native_dense`: the same weight bytes, kernels/csrc/dense.cpp, sums in one fixed order), so a
Qwen3-MoE or Mixtral checkpoint's experts run grouped too instead of a oneDNN call per expert.

Where the native kernels serve the model (`native`, set by layers/norm.py's `use_native`), routing
is one native op (`opentgi::moe_route`: the logits' sums in the kernel's own fixed order, the
softmax's exp its own: other bits than torch's, within float rounding) and the activation is the
native act-and-multiply; the single-call decode step (models/families/native_stack.py) runs the same.

LoRA adapters (`lora`, models/layers/expert_lora.py) add their deltas to the router's logits and
each expert's outputs; a step without adapter rows runs exactly the code above. With tensor parallelism each rank holds a slice of every expert's intermediate features (the
router is replicated, so every rank routes alike) and `tp` all-reduces the block's output once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opentgi.kernels import native
from opentgi.models.base import ForwardWithoutHooks
from opentgi.models.layers.elementwise import NATIVE_ACTIVATIONS, act_and_mul
from opentgi.models.layers.mlp import GatedMLP
from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight, native_dense_linear
from opentgi.models.quantization.linear import QuantizedLinear

ROUTER_TEMP_BYTES = 16 << 20  # the router's float32 products [rows, experts, hidden] held at once


class RouterLogits(ForwardWithoutHooks, nn.Module):
    """`x @ W.T` of a router (no bias): a float32 product with the weight and a sum over the hidden
    size per (row, expert), rounded to x's dtype (as a linear layer in x's dtype rounds its float32
    accumulation). Each row's sums are its own: the same bits for every row count. The products
    are formed `rows_at_once` rows at a time (a long prompt of a 128-expert model would otherwise
    hold gigabytes of them)."""

    def __init__(self, weight: torch.Tensor, temp_bytes: int = ROUTER_TEMP_BYTES):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().float(), persistent=False)
        self.rows_at_once = max(1, temp_bytes // (4 * self.out_features * self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.rows_at_once:
            return torch.mul(x.unsqueeze(1), self.weight).sum(dim=-1).to(x.dtype)
        return torch.cat([self(part) for part in x.split(self.rows_at_once)])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def native_dense(linear: nn.Module) -> nn.Module:
    """A bias-free dense CPU nn.Linear of a dtype the native kernels multiply (kernels.native's
    DENSE_TYPES) as a QuantizedLinear on them, holding the weight's own bytes; else `linear`."""
    dense = native_dense_linear(linear.weight) if type(linear) is nn.Linear and linear.bias is None else None
    return linear if dense is None else dense


def _blocks_of(linears: list[nn.Module]) -> list[GGUFBlockWeight] | None:
    """The linears' GGML-block weights, where each is a plain QuantizedLinear on the native
    kernels (no bias, no dense copy) and all share one block type, shape and activation passes."""
    formats = []
    for linear in linears:
        if (type(linear) is not QuantizedLinear or linear.bias is not None or linear.prompt_linear is not None
                or linear.dense_above_rows is not None or type(linear.weight_format) is not GGUFBlockWeight):
            return None
        formats.append(linear.weight_format)
    first = formats[0]
    same = all((f.qtype, f.out_features, f.in_features, f.passes) == (first.qtype, first.out_features,
                                                                       first.in_features, first.passes)
               for f in formats)
    return formats if same and native.loaded() is not None else None


class GroupedExperts:
    """Every expert's gate/up and down projections as GGML blocks, run for all tokens and experts in
    one native call per projection (module docstring)."""

    def __init__(self, gate_up: list[GGUFBlockWeight], down: list[GGUFBlockWeight], act_name: str, intermediate: int):
        self.gate_up = [f.blocks for f in gate_up]
        self.down = [f.blocks for f in down]
        self.gate_up_format, self.down_format = gate_up[0], down[0]
        self.act_name, self.intermediate = act_name, intermediate

    @classmethod
    def of(cls, experts: nn.ModuleList, act_name: str, intermediate: int) -> GroupedExperts | None:
        gate_up = _blocks_of([e.gate_up_proj for e in experts])
        down = _blocks_of([e.down_proj for e in experts])
        return None if gate_up is None or down is None else cls(gate_up, down, act_name, intermediate)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 use_native: bool = False) -> torch.Tensor:
        up, down = self.gate_up_format, self.down_format
        if use_native and self.act_name in NATIVE_ACTIVATIONS and x.dtype in (torch.float32, torch.bfloat16):
            # the native activation in the gate/up call: [T * k, intermediate], the bits of the two calls below
            hidden = native.moe_up(x, self.gate_up, up.qtype, experts, up.out_features, up.passes,
                                   gelu_tanh=bool(NATIVE_ACTIVATIONS[self.act_name]))
        else:
            gate_up = native.moe_up(x, self.gate_up, up.qtype, experts, up.out_features, up.passes)
            # [T, k, intermediate], as the per-expert path's one pass
            hidden = act_and_mul(gate_up, self.intermediate, self.act_name, use_native)
        return native.moe_down(hidden.view(-1, self.intermediate), self.down, down.qtype, experts, weights,
                               down.out_features, down.passes)


class SparseMoE(ForwardWithoutHooks, nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 act: str, names: tuple[str, str, str]):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate = intermediate
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([GatedMLP(hidden, intermediate, act, names=names)
                                      for _ in range(num_experts)])
        self.act = self.experts[0].act
        self.tp = None  # models.parallel.TPGroup when sharded: the output is all-reduced
        self.lora = None  # layers.expert_lora.ExpertLora when LoRA adapters adapt this block
        self.grouped: GroupedExperts | None = None  # set by fuse_projections where the experts allow
        self.native = False  # routing and the activation as native ops (layers/norm.py's `use_native`)

    def fuse_projections(self) -> None:
        for expert in self.experts:  # the grouped kernel takes each expert's gate and up as one weight
            expert.fuse_projections(copy_file_blocks=True)
            if self.native:  # dense experts onto the native kernels (module docstring)
                expert.gate_up_proj, expert.down_proj = native_dense(expert.gate_up_proj), native_dense(expert.down_proj)
        if type(self.gate) is nn.Linear and self.gate.bias is None:  # a quantized router stays as it is
            self.gate = RouterLogits(self.gate.weight)
        self.group_experts()

    def group_experts(self) -> None:
        """The grouped call's weights, taken from the experts' formats as they are now (again after
        a repack by sixteen rows: gguf_blocks.repack_by_16_rows)."""
        self.grouped = GroupedExperts.of(self.experts, self.experts[0].act_name, self.intermediate)

    def route(self, x: torch.Tensor, lora: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, experts [T, k] int64); `lora`: the step
        has adapter rows, whose adapters' router deltas are added."""
        if (self.native and not lora and type(self.gate) is RouterLogits and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16)):
            return native.moe_route(x, self.gate.weight, self.top_k, self.renormalize)
        logits = self.gate(x)
        if lora:
            logits = self.lora.add_router(x, logits)
        if self.renormalize:  # the top k's softmax: their full-softmax weights renormalised, in two ops
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return F.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype), experts
        weights, experts = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        return weights.to(x.dtype), experts

    def _run_experts(self, rows: torch.Tensor, used: list[tuple[int, int, tuple[int, ...]]],
                     masks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """rows [R, hidden] -> outputs [R, hidden]: each (expert, count, slots) of `used` takes the
        next `count` rows; the activation runs once over all of them. `slots`: the LoRA adapters
        (slots) of the expert's rows, each adding its delta masked by `masks[slot]` ([R, 1]: its
        rows); empty (and `masks` None) in a step without adapter rows."""
        gate_up = self._each_expert("gate_up_proj", rows, used, masks)
        # one elementwise pass over every expert's rows (natively as the grouped path: `native`)
        hidden = act_and_mul(gate_up, self.intermediate, self.experts[0].act_name, self.native)
        return self._each_expert("down_proj", hidden, used, masks)

    def _each_expert(self, projection: str, rows: torch.Tensor, used: list[tuple[int, int, tuple[int, ...]]],
                     masks: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """Each expert of `used` multiplies its next rows by its `projection`, plus its rows'
        adapters' deltas (from the rows converted to float32 once for every expert)."""
        lora_rows = None if masks is None else rows.float()
        outs, start = [], 0
        for e, count, slots in used:
            y = getattr(self.experts[e], projection)(rows[start:start + count])
            for s in slots:
                self.lora.add_delta(projection, e, s, lora_rows, masks[s], start, count, y)
            outs.append(y)
            start += count
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        lora = self.lora is not None and self.lora.active()
        weights, experts = self.route(x, lora)
        if self.grouped is not None and not lora:
            out = self.grouped(x, weights, experts, self.native)
            return out if self.tp is None else self.tp.all_reduce(out)
        if x.shape[0] == 1:
            return self._one_token(x, weights[0], experts[0], lora)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if not lora:
            used = [(e, c, ()) for e, c in enumerate(counts.tolist()) if c]  # the one host sync
        else:  # and which adapters each expert's rows use, in the same sync
            counts, slots = self.lora.expert_slots(experts, counts)
            used = [(e, c, slots[e]) for e, c in enumerate(counts) if c]
        token_of = order // self.top_k
        masks = self.lora.row_masks(token_of) if lora else None
        out_rows = self._run_experts(x.index_select(0, token_of), used, masks)
        out_rows.mul_(weights.flatten().index_select(0, order).unsqueeze(1))
        out = torch.zeros_like(x).index_add_(0, token_of, out_rows)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   lora: bool = False) -> torch.Tensor:
        ids = experts.tolist()  # the one host sync
        slots, masks = (), None
        if lora:  # the lone token's adapter is the step's one
            slots = self.lora.state.step.used_key
            masks = {slots[0]: torch.ones(len(ids), 1, device=x.device)}
        out_rows = self._run_experts(x.expand(len(ids), -1), [(e, 1, slots) for e in ids], masks)
        # weighted in x's dtype, as there; summed in float32 in expert order, rounded once
        out_rows.mul_(weights.unsqueeze(1))
        if len(ids) == 2:  # torch adds two values of x's dtype in float32 and rounds once: as below
            out = out_rows[:1] + out_rows[1:]
        else:
            wide = out_rows.float()
            order = sorted(range(len(ids)), key=ids.__getitem__)
            total = wide[order[0]]
            for j in order[1:]:
                total = total + wide[j]
            out = total.unsqueeze(0).to(x.dtype)
        return out if self.tp is None else self.tp.all_reduce(out)
