"""A decode step's decoder layers in one native call (`opentgi::decode_stack`, kernels/csrc/stack.cpp).

Where the native kernels serve a decoder whose projections are all GGUF blocks (a GGUF file, q/k/v
or gate/up of one block type or of several, as in Q4_K_M; or `--quantize`/AWQ/GPTQ in the native
layouts), a step whose every token the native attention attends as a decode row (decode rows; with
batch invariance also speculative verify tokens) runs all its layers in one call instead of some
forty torch ops and their Python a layer. The layers it computes: Llama's (Llama, Mistral, Qwen2,
Phi-3), with q and k normed per head (Qwen3), routed experts (Qwen3-MoE, Mixtral: the router, the
top k and the grouped expert calls of models/layers/moe.py), and Gemma's: (1 + w) RMSNorms, sandwich
norms, GELU(tanh)-gated MLPs, soft-capped attention logits, the query pre-attention scalar, sliding
windows per layer and the local layers' own RoPE table (Gemma 2, Gemma 3). The call runs the same functions
the layer's modules call one by one, in their order and with their roundings, so the hidden states
are the module-by-module step's bit for bit (tests/kernels/test_kernels_stack.py); batch invariance
carries over unchanged.

The decoder's final norm runs in the same call where it is the layers' kind of RMSNorm, so does
the token embedding's lookup where it is a GGUF file's Q8_0 blocks (and not scaled), and with
these two a step whose every row is sampled can have its logits of the same call (the LM head's
GGUF blocks, `logits=True`: ModelRunner.execute through PagedDecoder.decode_logits), and the
arguments that stay the same from step to step (weights, shapes, the paged caches) are converted
once into an `opentgi.DecodeStackArgs` (`decode_stack_run`): a step passes only its own tensors.

Layers of another shape (LayerNorm, plain MLPs, M-RoPE, a quantized router, LoRA adapters, dense
or other-format projections) and every other step (prompt tokens, images) take the modules.
"""

from __future__ import annotations

import operator

import torch
from gguf import GGMLQuantizationType
from torch import nn

from opentgi.kernels import native
from opentgi.models.attention.metadata import AttentionMetadata
from opentgi.models.attention.torch_plan import NativeRows, make_plan
from opentgi.models.layers.elementwise import NATIVE_ACTIVATIONS
from opentgi.models.layers.mlp import GatedMLP
from opentgi.models.layers.moe import RouterLogits, SparseMoE
from opentgi.models.layers.norm import GemmaRMSNorm, HeadsNorm, RMSNorm
from opentgi.models.layers.rotary import RotaryEmbedding
from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight, GGUFEmbedding
from opentgi.models.quantization.linear import ConcatLinear, QuantizedLinear

PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))
ATTENTION = PROJECTIONS[:2]
NORMS = ("input_layernorm", "post_attention_layernorm")
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")

# How many submodules were assigned anywhere (nn.Module.__setattr__, add_module): a stack checks
# its modules' places again only when this moved (an adapter's wrapper is assigned in their place,
# models/lora/attach.py), not on every step.
_assignments = [0]


def _count_assignment(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _assignments[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_assignment)


def _taken(layer: nn.Module) -> list[tuple[str, str]]:
    """(owner attribute, name) of each module of `layer` whose weights the stack takes: its four
    projections, or with routed experts the attention's two and the experts' block."""
    if isinstance(layer.feed_forward, SparseMoE):
        return [*ATTENTION, ("", layer.mlp_attr)]
    return list(PROJECTIONS)


def _module(layer: nn.Module, owner: str, name: str) -> nn.Module | None:
    return getattr(getattr(layer, owner) if owner else layer, name, None)


def _experts_served(moe: SparseMoE, dtype: torch.dtype) -> bool:
    """Whether the stack computes `moe` as its modules do: the float32 router, the grouped native
    experts, the native ops, no adapters, no tensor parallelism."""
    return (type(moe.gate) is RouterLogits and moe.grouped is not None and moe.native and moe.lora is None
            and moe.tp is None and moe.experts[0].act_name in NATIVE_ACTIVATIONS)


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The weight the native op takes: RMSNorm's own, GemmaRMSNorm's 1 + w in float32."""
    return norm.scale() if type(norm) is GemmaRMSNorm else norm.weight.detach()


def _parts(linear: nn.Module | None) -> list[QuantizedLinear] | None:
    """The projection as GGUF-block linears multiplied by their blocks alone (no dense copy for
    prompt rows): itself, or a ConcatLinear's parts (projections of different block types), else None."""
    parts = list(linear.parts) if type(linear) is ConcatLinear else [linear]
    for part in parts:
        if (type(part) is not QuantizedLinear or part.prompt_linear is not None or part.dense_above_rows is not None
                or not isinstance(part.weight_format, GGUFBlockWeight)):
            return None
    return parts


def _head(model) -> tuple[str, nn.Module | None]:
    """(attribute, module) of the model's LM head as `compute_logits` takes it, where it is a
    module without a soft-cap after it."""
    if model.layout.final_softcap is not None or not getattr(model, "has_lm_head", False):
        return "", None
    if getattr(model, "logits_proj", None) is not None:
        return "logits_proj", model.logits_proj
    if not model.tie_word_embeddings and isinstance(getattr(model, "lm_head", None), nn.Module):
        return "lm_head", model.lm_head
    return "", None


class NativeDecodeStack:
    """The decoder's layers as the arguments of one `opentgi::decode_stack` call."""

    def __init__(self, model, modules: list[nn.Module]):
        layers = model.model.layers
        attn = layers[0].self_attn
        # where each module whose weights were taken sits (its parent's module dict, its name): one
        # replaced there (an adapter's wrapper) ends the stack; dict lookups, not nn.Module attributes,
        # as this is checked every step
        taken = iter(modules)
        self.places = [((getattr(layer, owner) if owner else layer)._modules, name, next(taken))
                       for layer in layers for owner, name in _taken(layer)]
        embedding = model.model.embed_tokens
        # a Q8_0 embedding the call looks token ids up in (GGUFEmbedding's rows), or None
        self.embedding = (embedding.gguf_blocks if type(embedding) is GGUFEmbedding and model.embed_scale is None
                          and embedding.qtype == GGMLQuantizationType.Q8_0 and embedding.dtype == model.spec.dtype
                          and embedding.gguf_blocks.dtype == torch.uint8 else None)
        if self.embedding is not None:
            self.places.append((model.model._modules, "embed_tokens", embedding))
        self.columns = tuple(zip(*self.places))  # (dicts, names, modules): checked by maps, no Python loop
        self.layers = layers
        self.dtype = model.spec.dtype
        self.backend = attn.backend
        self.num_heads, self.num_kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, float(attn.scale)
        self.checked_at = -1  # `_assignments` when the places were last found unchanged
        self.rotary = list(model.rotary)
        self.final_norm = model.model.norm  # norms the last layer's output, in the native call where it can
        final = self.final_norm
        in_call = (type(final) is type(layers[0].input_layernorm) and final.native
                   and final.weight.dtype == self.dtype)
        self.final_weight = _norm_weight(final) if in_call else None
        self.final_eps = float(final.eps) if in_call else 0.0
        if in_call:
            self.places.append((model.model._modules, "norm", final))
        head_name, head = _head(model)
        parts = _parts(head) if head is not None and in_call and self.embedding is not None else None
        # the LM head's weight format where the call can end with it (one GGUF-block part, no bias)
        self.head = parts[0].weight_format if parts is not None and len(parts) == 1 and parts[0].bias is None else None
        if self.head is not None:
            self.places.append((model._modules, head_name, head))
        self.columns = tuple(zip(*self.places))  # with the final norm's and the head's places
        self.args = None  # the DecodeStackArgs of `bound`
        self.bound: tuple[list, int] | None = None  # (the kv caches' list, the ISA id) `args` hold
        self.windows = [int(layer.self_attn.sliding_window or 0) for layer in layers]
        self.window0 = attn.sliding_window
        self.softcap = float(attn.extra.get("softcap") or 0.0)
        first_ff = layers[0].feed_forward
        self.act = NATIVE_ACTIVATIONS[(first_ff.experts[0] if isinstance(first_ff, SparseMoE) else first_ff).act_name]
        self.ropes = [layer.rope for layer in layers]  # each layer's RoPE table
        self.eps = float(layers[0].input_layernorm.eps)
        self.weights: list[torch.Tensor] = []
        self.qtypes: list[int] = []
        self.passes: list[int] = []  # each weight's activation passes (models/quantization/gguf_blocks.py)
        self.biases: list[torch.Tensor | None] = []
        self.parts: list[int] = []  # per projection: how many of the weights above are its parts
        self.norms: list[torch.Tensor] = []  # 2 a layer, 4 with sandwich norms
        self.qk_norms = [layer.self_attn.heads_norm.weight for layer in layers] if attn.qk_norm else []
        self.routers: list[torch.Tensor | None] = []  # per layer: a routed-experts layer's float32 router
        self.expert_weights: list[torch.Tensor] = []  # per routed layer: each expert's gate_up, then down
        self.expert_types: list[int] = []  # per routed layer: gate_up's qtype, passes, outputs; down's qtype, passes
        self.top_k, self.renormalize = 1, True
        for layer in layers:
            ff = layer.feed_forward
            moe = ff if isinstance(ff, SparseMoE) else None
            self.routers.append(moe.gate.weight if moe is not None else None)
            if moe is not None:
                grouped = moe.grouped
                self.expert_weights += [*grouped.gate_up, *grouped.down]
                up, down = grouped.gate_up_format, grouped.down_format
                self.expert_types += [up.qtype, up.passes, up.out_features, down.qtype, down.passes]
                self.top_k, self.renormalize = moe.top_k, moe.renormalize
            for owner, name in PROJECTIONS:
                if moe is not None and owner == "mlp":
                    self.parts.append(0)
                    continue
                parts = _parts(getattr(getattr(layer, owner), name))
                self.parts.append(len(parts))
                for part in parts:
                    self.weights.append(part.weight_format.blocks)
                    self.qtypes.append(part.weight_format.qtype)
                    self.passes.append(part.weight_format.passes)
                    self.biases.append(part.bias)
            self.norms += [_norm_weight(getattr(layer, name)) for name in (SANDWICH_NORMS if layer.sandwich else NORMS)]

    @classmethod
    def build(cls, model) -> NativeDecodeStack | None:
        """The stack for `model` (a PagedDecoder after `materialize`), or None where a layer is of
        another shape than the one the native call computes."""
        layout = model.layout
        structure = layout.structure
        dtype = model.spec.dtype
        if (structure.norm not in ("rms", "gemma_rms") or not 1 <= len(model.rotary) <= 2
                or any(type(rotary) is not RotaryEmbedding for rotary in model.rotary)
                or dtype not in (torch.float32, torch.bfloat16) or not model.model.layers
                or getattr(model, "lora", None) is not None):
            return None
        norm_type = RMSNorm if structure.norm == "rms" else GemmaRMSNorm
        modules: list[nn.Module] = []
        acts, moes = set(), []
        for layer in model.model.layers:
            ff = layer.feed_forward
            if isinstance(ff, SparseMoE):
                if not _experts_served(ff, dtype):
                    return None
                acts.add(ff.experts[0].act_name in ("silu", "swish"))
                moes.append((ff.top_k, ff.renormalize))
            elif layer.mlp_attr != "mlp" or not isinstance(ff, GatedMLP) or ff.act_name not in NATIVE_ACTIVATIONS \
                    or not ff.native:
                return None
            else:
                acts.add(ff.act_name in ("silu", "swish"))
            attn = layer.self_attn
            if set(attn.extra) - {"softcap"} or getattr(attn.backend, "name", None) != "native":
                return None
            if attn.qk_norm and (type(attn.heads_norm) is not HeadsNorm or not attn.heads_norm.native
                                 or attn.heads_norm.eps != layer.input_layernorm.eps):
                return None
            for name in SANDWICH_NORMS if layer.sandwich else NORMS:
                norm = getattr(layer, name)
                if (type(norm) is not norm_type or not norm.native or norm.weight.dtype != dtype
                        or norm.eps != layer.input_layernorm.eps):
                    return None
            for owner, name in _taken(layer):
                module = _module(layer, owner, name)
                if owner == "":
                    modules.append(module)
                    continue
                parts = _parts(module) if module is not None else None
                if parts is None or any(p.bias is not None and p.bias.dtype != dtype for p in parts):
                    return None
                modules.append(module)
        layers = model.model.layers
        if (len(acts) > 1 or len(set(moes)) > 1 or len({layer.self_attn.extra.get("softcap") for layer in layers}) > 1
                or any(layer.rope >= len(model.rotary) for layer in layers)):
            return None
        return cls(model, modules)

    def _unchanged(self) -> bool:
        count = _assignments[0]
        if count == self.checked_at:
            return True
        places, names, modules = self.columns
        if not all(map(operator.is_, map(dict.get, places, names), modules)):
            return False
        self.checked_at = count
        return True

    def _args(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], isa: int):
        """The DecodeStackArgs of these caches (the runner's list, which it never changes) and ISA,
        made on the first step that passes them (and holding those caches until another list comes)."""
        bound = self.bound
        if bound is None or bound[0] is not kv_caches or bound[1] != isa:
            self.args = torch.classes.opentgi.DecodeStackArgs(
                self.ropes, self.weights, self.qtypes, self.passes, self.biases, self.parts, self.norms,
                self.qk_norms, [k for k, _ in kv_caches], [v for _, v in kv_caches], self.num_heads,
                self.num_kv_heads, self.scale, self.windows, self.softcap, self.act, self.eps, self.routers,
                self.expert_weights, self.expert_types, self.top_k, self.renormalize, isa, self.final_weight,
                self.final_eps, self.embedding, self.dtype == torch.bfloat16,
                None if self.head is None else self.head.blocks, 0 if self.head is None else self.head.qtype,
                1 if self.head is None else self.head.passes, 0 if self.head is None else self.head.out_features)
            self.bound = (kv_caches, isa)
        return self.args

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits: bool = False,
                 greedy: int = 0) -> torch.Tensor | None:
        """The decoder's output for this step (the last layer's, normed by the final norm; with
        `logits`, where `head` is set, the LM head's output of it instead; with `greedy` > 0 as
        well, each row's argmax over the first `greedy` of those logits, int64), or None where the step
        has tokens the native attention does not attend as decode rows (the modules take it).
        h: the rows [rows, hidden], or with `embedding` the token ids int64 [rows]; positions:
        int64 [rows]."""
        if (h.dtype != self.dtype and (h.dim() != 1 or self.embedding is None)) or meta.image_spans \
                or not self._unchanged():
            return None
        window = self.window0 if self.window0 is not None and self.window0 < meta.max_seqlen_k else None
        group = self.num_heads // self.num_kv_heads
        # the plan the first layer's attention would make, in the hidden rows' dtype (h may be ids)
        key = ("native", window, self.dtype, group)
        plan = meta.scratch.get(key)
        if plan is None:
            backend = self.backend
            plan = meta.scratch[key] = make_plan(meta, kv_caches[0][0].shape[1], window, self.dtype, group,
                                                 backend.batch_invariant, backend.prompt_form, native=True)
        rows, prompt = plan.native, None
        if plan.native_prompt is not None:  # prompt tokens in their own form beside decode rows
            if logits:
                return None
            rows, prompt = self._both_forms(meta, plan)
        if rows is None or not rows.in_order:
            return None
        args = self._args(kv_caches, native.ISAS[self.backend.isa or native.loaded().isa])
        tables = [rotary.tables(self.dtype, meta.max_seqlen_k) for rotary in self.rotary]
        op = torch.ops.opentgi.decode_stack_run
        # the op's C++ entry (`_op`): the packet's own call first walks the arguments for fake
        # script objects (torch.compile's), which a step never passes
        out = getattr(op, "_op", op)(args, h, positions, [cos for cos, _ in tables], [sin for _, sin in tables],
                                     meta.slot_mapping, plan.tails, rows.block_tables, rows.seq, rows.ctx, logits,
                                     prompt, min(greedy, self.head.out_features) if logits and greedy else 0)
        return out if self.final_weight is not None else self.final_norm(out)

    @staticmethod
    def _both_forms(meta: AttentionMetadata, plan) -> tuple[NativeRows | None, torch.Tensor | None]:
        """Every token of a step with prompt tokens as one list of rows in step order (each row's
        table and context, as both native forms take them) and a bool [rows], True for the prompt
        form's; (None, None) where some token is left to the torch forms."""
        forms = [r for r in (plan.native, plan.native_prompt) if r is not None]
        total = int(meta.cu_seqlens_q[-1])
        if sum(int(r.tokens.numel()) for r in forms) != total:
            return None, None
        tokens = torch.cat([r.tokens for r in forms])
        seq, ctx = torch.empty(total, dtype=torch.int32), torch.empty(total, dtype=torch.int32)
        seq[tokens], ctx[tokens] = torch.cat([r.seq for r in forms]), torch.cat([r.ctx for r in forms])
        prompt = torch.zeros(total, dtype=torch.bool)
        prompt[plan.native_prompt.tokens] = True
        return NativeRows(torch.arange(total), seq, ctx, plan.native_prompt.block_tables, True), prompt
