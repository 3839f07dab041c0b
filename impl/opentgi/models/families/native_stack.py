"""A decode step's decoder layers in one native call (`opentgi::decode_stack`, kernels/csrc/ops.cpp).

Where the native kernels serve a Llama-shaped decoder whose projections are all GGUF blocks (a GGUF
file, q/k/v or gate/up of one block type or of several, as in Q4_K_M; or `--quantize`/AWQ/GPTQ in the
native layouts), a step whose every token
the native attention attends as a decode row (decode rows; with batch invariance also speculative
verify tokens) runs all its layers in one call instead of some forty torch ops and their Python a
layer. The call runs the same functions the layer's modules call one by one, in their order and
with their roundings, so the hidden states are the module-by-module step's bit for bit
(tests/models/test_native_stack.py); batch invariance carries over unchanged.

Layers of another shape (sandwich norms, q/k norms, soft-capping, experts, two RoPE tables, LoRA
adapters, dense or other-format projections) and every other step (prompt tokens) take the modules.
"""

from __future__ import annotations

import torch
from torch import nn

from opentgi.kernels import native
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.torch_plan import make_plan
from opentgi.models.layers.mlp import GatedMLP
from opentgi.models.layers.norm import RMSNorm
from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight
from opentgi.models.quantization.linear import ConcatLinear, QuantizedLinear

PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def _parts(linear: nn.Module | None) -> list[QuantizedLinear] | None:
    """The projection as GGUF-block linears multiplied by their blocks alone (no dense copy for
    prompt rows): itself, or a ConcatLinear's parts (projections of different block types), else None."""
    parts = list(linear.parts) if type(linear) is ConcatLinear else [linear]
    for part in parts:
        if (type(part) is not QuantizedLinear or part.prompt_linear is not None or part.dense_above_rows is not None
                or not isinstance(part.weight_format, GGUFBlockWeight)):
            return None
    return parts


class NativeDecodeStack:
    """The decoder's layers as the arguments of one `opentgi::decode_stack` call."""

    def __init__(self, model, modules: list[nn.Module]):
        layers = model.model.layers
        attn = layers[0].self_attn
        # where each module whose weights were taken sits (its parent's module dict, its name): one
        # replaced there (an adapter's wrapper) ends the stack; dict lookups, not nn.Module attributes,
        # as this is checked every step
        taken = iter(modules)
        self.places = [(getattr(layer, owner)._modules, name, next(taken))
                       for layer in layers for owner, name in PROJECTIONS]
        self.layers = layers
        self.backend = attn.backend
        self.num_heads, self.num_kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, float(attn.scale)
        self.windows = [int(layer.self_attn.sliding_window or 0) for layer in layers]
        self.window0 = attn.sliding_window
        self.eps = float(layers[0].input_layernorm.eps)
        self.weights: list[torch.Tensor] = []
        self.qtypes: list[int] = []
        self.passes: list[int] = []  # each weight's activation passes (models/quantization/gguf_blocks.py)
        self.biases: list[torch.Tensor | None] = []
        self.parts: list[int] = []  # per projection: how many of the weights above are its parts
        self.norms: list[torch.Tensor] = []
        for layer in layers:
            for owner, name in PROJECTIONS:
                parts = _parts(getattr(getattr(layer, owner), name))
                self.parts.append(len(parts))
                for part in parts:
                    self.weights.append(part.weight_format.blocks)
                    self.qtypes.append(part.weight_format.qtype)
                    self.passes.append(part.weight_format.passes)
                    self.biases.append(part.bias)
            self.norms += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]

    @classmethod
    def build(cls, model) -> NativeDecodeStack | None:
        """The stack for `model` (a PagedDecoder after `materialize`), or None where a layer is of
        another shape than the one the native call computes."""
        layout = model.layout
        structure = layout.structure
        if (structure.sandwich_norms or structure.qk_norm or structure.embed_scale or structure.norm != "rms"
                or layout.attn_softcap or any(layout.moe) or any(layout.local_rope) or len(model.rotary) != 1
                or model.spec.dtype not in (torch.float32, torch.bfloat16) or not model.model.layers
                or getattr(model, "lora", None) is not None):
            return None
        modules: list[nn.Module] = []
        for layer in model.model.layers:
            if layer.mlp_attr != "mlp" or not isinstance(layer.mlp, GatedMLP) or layer.mlp.act_name != "silu":
                return None
            attn = layer.self_attn
            if attn.extra or getattr(attn.backend, "name", None) != "native":
                return None
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if type(norm) is not RMSNorm or not norm.native or norm.weight.dtype != model.spec.dtype:
                    return None
            for owner, name in PROJECTIONS:
                linear = getattr(getattr(layer, owner), name, None)
                parts = _parts(linear) if linear is not None else None
                if parts is None or any(p.bias is not None and p.bias.dtype != model.spec.dtype for p in parts):
                    return None
                modules.append(linear)
        return cls(model, modules)

    def _unchanged(self) -> bool:
        return all(place.get(name) is module for place, name, module in self.places)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The last layer's output for this step (before the final norm), or None where the step
        has tokens the native attention does not attend as decode rows (the modules take it)."""
        if h.dtype != self.norms[0].dtype or meta.image_spans or not self._unchanged():
            return None
        window = self.window0 if self.window0 is not None and self.window0 < meta.max_seqlen_k else None
        group = self.num_heads // self.num_kv_heads
        key = ("native", window, h.dtype, group)  # the plan the first layer's attention would make
        plan = meta.scratch.get(key)
        if plan is None:
            backend = self.backend
            plan = meta.scratch[key] = make_plan(meta, kv_caches[0][0].shape[1], window, h.dtype, group,
                                                 backend.batch_invariant, backend.prompt_form, native=True)
        rows = plan.native
        if rows is None or not rows.in_order:
            return None
        path = native.loaded()
        return torch.ops.opentgi.decode_stack(
            h, cos.contiguous(), sin.contiguous(), self.weights, self.qtypes, self.passes, self.biases, self.parts,
            self.norms,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping, plan.tails,
            rows.block_tables, rows.seq, rows.ctx, self.num_heads, self.num_kv_heads, self.scale, self.windows,
            self.eps, native.ISAS[self.backend.isa or path.isa])
