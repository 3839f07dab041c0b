"""A GGUF file read as it is: the model's config from the file's metadata and its tensors straight
from the memory-mapped file (gguf-py's `GGUFReader`), with no conversion and nothing written.

The header is read by gguf_header.py (metadata and tensor index in one pass). Tensors come under
Hugging Face's names (so the paged model loads them as it loads a safetensors
folder). Where the native kernels serve (`native_types`, set by the loader from `--kernels`),
layer projections and an untied LM head of those block types come as `GGUFBlocks`, views of the
file's blocks (models/quantization/gguf_blocks.py), and so do the token embedding and a tied head
(`embedding_blocks`, `tied_head_blocks`).
Otherwise layer projections in Q4_0, Q4_1 or Q4_K come as `Int4Groups` (served by torch's int4
kernel, models/quantization/ggml.py); every other tensor comes as a `DenseTensor`, dequantized
once (models/quantization/ggml.py), into its weight a chunk of rows at a time. llama.cpp stores a
Llama's q and k rows permuted for its rotary layout; they are put back in Hugging Face's order (a
permutation of output rows, which moves whole quantization blocks). A mixture of experts (a
Mixtral: "llama" with `expert_count`; a Qwen3-MoE: "qwen3moe") stores each projection's experts
stacked in one tensor; each expert comes as its own weight, a view of its rows (`ExpertSlice`).
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from opentgi.models.checkpoints.gguf_header import GGUFHeader
from opentgi.models.checkpoints.gguf_slice import read_slice
from opentgi.models.quantization import ggml
from opentgi.models.quantization.gguf_blocks import GGUFBlocks

# GGUF architecture -> (transformers config class, architecture, q/k rows permuted by llama.cpp)
_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", True),
    "mistral": ("MistralConfig", "MistralForCausalLM", True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", False),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# routed experts (a Mixtral: llama.cpp's "llama" with `expert_count`; a Qwen3-MoE: "qwen3moe"):
# the router (ffn_gate_inp) and each projection's experts stacked in one tensor [experts, rows,
# columns], served as one Hugging Face weight per expert (a view of its rows)
_MOE_NAMES = {
    "llama": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
    "qwen3moe": ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}),
}
_EXPERT_TENSORS = frozenset(_MOE_NAMES["llama"][1])
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PROJECTION = re.compile(r"model\.layers\.\d+\.(?:(?:self_attn|mlp)\.\w+_proj"
                         r"|(?:block_sparse_moe|mlp)\.experts\.\d+\.(?:w[123]|\w+_proj))\.weight$")


_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether one block of `qtype` dequantizes (ggml.dense: its own steps or gguf-py's)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    try:
        ggml.dense(np.zeros((1, type_size), dtype=np.uint8), qtype, (1, block))
    except (NotImplementedError, ValueError, KeyError, TypeError):
        return False
    return True


class GGUFError(ValueError):
    """The file is not a model the paged path can serve; the message says why."""


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.match(gguf_name)
    if match and match.group(2) == "ffn_gate_inp" and arch in _MOE_NAMES:
        return f"model.layers.{match.group(1)}.{_MOE_NAMES[arch][0]}.gate.{match.group(3)}"
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return None


@dataclass
class ExpertSlice:
    """One expert's rows of a stacked experts tensor, read like the file's own tensors."""
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, ...]  # GGUF's order (columns first)


def _expanded(tensors: dict, arch: str) -> Iterator[tuple[str, str | None, object]]:
    """(GGUF name, Hugging Face name or None, tensor) of every tensor, a stacked experts tensor
    as one entry per expert."""
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        if match and match.group(2) in _EXPERT_TENSORS and match.group(3) == "weight" and arch in _MOE_NAMES:
            block, names = _MOE_NAMES[arch]
            experts, rows = int(tensor.shape[2]), int(tensor.shape[1])  # GGUF's order: columns, rows, experts
            data = np.asarray(tensor.data).reshape(experts, rows, -1)  # the file's [rows, bytes] per expert
            prefix = f"model.layers.{match.group(1)}.{block}.experts"
            for e in range(experts):
                hf = f"{prefix}.{e}.{names[match.group(2)]}.weight"
                yield name, hf, ExpertSlice(f"{name}[{e}]", tensor.tensor_type, data[e], tuple(tensor.shape[:2]))
        else:
            yield name, hf_name(name, arch), tensor


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights):
    row r of the result is row index[r] of the GGUF tensor."""
    dim = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, dim, 2).transpose(1, 2).reshape(num_rows)


@dataclass
class DenseTensor:
    """A tensor of the file served dense, not dequantized yet: `copy_into` a weight (a chunk of
    rows at a time, models/quantization/ggml.py), or `tensor()` whole in float32."""
    raw: np.ndarray
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    order: torch.Tensor | None = None  # rows put back in Hugging Face's order (llama.cpp's q/k permutation)

    def tensor(self) -> torch.Tensor:
        value = ggml.dense(self.raw, self.qtype, self.shape)
        return value if self.order is None else value[self.order]

    def copy_into(self, dest: torch.Tensor) -> None:
        if self.order is not None:  # a permuted q or k: one layer's, copied whole
            dest.copy_(self.tensor())
        else:
            ggml.dense_into(dest, self.raw, self.qtype, self.shape)


class GGUFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.header = GGUFHeader(self.path)
        except (ValueError, OSError, struct.error) as exc:
            raise GGUFError(f"{self.path} is not a readable GGUF file: {exc}") from None
        self.arch = self._str("general.architecture")
        if self.arch not in _ARCHITECTURES:
            raise GGUFError(f"GGUF architecture {self.arch!r} has no paged implementation "
                            f"(served: {', '.join(sorted(_ARCHITECTURES))})")
        self.tensors = self.header.tensors
        self.packed_cache = None  # a PackedCache (packed_cache.py), set by the loader on CPU
        self.keep_int4 = True  # False (--dequantize): every tensor served dense
        self.native_types: frozenset[int] = frozenset()  # GGML types served on their blocks (native kernels)

    @property
    def metadata(self) -> dict[str, object]:
        return self.header.fields

    def _field(self, key: str, default=None):
        return self.header.fields.get(key, default)

    def _str(self, key: str) -> str | None:
        value = self._field(key)
        return value if isinstance(value, str) else None

    def _arch(self, key: str, default=None):
        return self._field(f"{self.arch}.{key}", default)

    def config(self):
        """A transformers config for the file's model, from its metadata."""
        import transformers

        config_class, architecture, _ = _ARCHITECTURES[self.arch]
        scaling = self._arch("rope.scaling.type")
        if scaling not in (None, "none"):
            raise GGUFError(f"GGUF rope scaling {scaling!r} is not supported")
        heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        vocab = self._arch("vocab_size") or self.header.array_lengths.get("tokenizer.ggml.tokens")
        if vocab is None:
            vocab = int(self.tensors["token_embd.weight"].shape[1])
        kwargs = dict(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._arch("feed_forward_length") or self._arch("expert_feed_forward_length")),
            num_hidden_layers=int(self._arch("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._arch("attention.head_count_kv", heads)),
            max_position_embeddings=int(self._arch("context_length", 2048)),
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in self.tensors,
            architectures=[architecture],
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self._field("tokenizer.ggml.padding_token_id"),
        )
        experts = int(self._arch("expert_count", 0) or 0)
        used = int(self._arch("expert_used_count", 2))
        if experts and self.arch == "llama":  # a Mixtral
            config_class, architecture = "MixtralConfig", "MixtralForCausalLM"
            kwargs.update(architectures=[architecture], num_local_experts=experts, sliding_window=None,
                          num_experts_per_tok=used)
        elif self.arch == "qwen3moe":  # llama.cpp renormalises the top k's weights
            kwargs.update(num_experts=experts, num_experts_per_tok=used, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], moe_intermediate_size=int(self._arch("expert_feed_forward_length")))
        head_dim = self._arch("attention.key_length")
        if head_dim is not None and int(head_dim) != hidden // heads:
            kwargs["head_dim"] = int(head_dim)
        return getattr(transformers, config_class)(**kwargs)

    def int4_names(self) -> set[str]:
        """Hugging Face names of the linear weights (layer projections, an untied LM head) that load
        quantized: as GGUFBlocks (a type in `native_types`) or as Int4Groups."""
        found: set[str] = set()
        if not self.keep_int4:
            return found
        for _, hf, tensor in _expanded(self.tensors, self.arch):
            if hf and (_PROJECTION.match(hf) or hf == "lm_head.weight") and self._quantized(tensor.tensor_type):
                found.add(hf)
        return found

    def _quantized(self, qtype: GGMLQuantizationType) -> bool:
        return qtype in ggml.INT4_TYPES or int(qtype) in self.native_types

    def embedding_blocks(self) -> GGUFBlocks | None:
        """The token embedding's blocks, where the native kernels serve its type: looked up as
        they are (gguf_blocks.GGUFEmbedding) and, for a tied LM head, multiplied by."""
        tensor = self.tensors.get("token_embd.weight")
        if not self.keep_int4 or tensor is None or int(tensor.tensor_type) not in self.native_types:
            return None
        return GGUFBlocks(np.asarray(tensor.data), int(tensor.tensor_type), tuple(reversed(tensor.shape)))

    def tied_head_blocks(self) -> GGUFBlocks | None:
        """The embedding's blocks for a tied LM head the native kernels multiply by."""
        return None if "output.weight" in self.tensors else self.embedding_blocks()

    def dense_types(self) -> dict[str, int]:
        """Block types served dense (no 4-bit form) -> how many tensors of that type."""
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            qtype = tensor.tensor_type
            if not self._quantized(qtype) and qtype not in (GGMLQuantizationType.F32,):
                counts[qtype.name] = counts.get(qtype.name, 0) + 1
        return counts

    def _named(self) -> Iterator[tuple[str, object, tuple[int, ...], torch.Tensor | None]]:
        """(Hugging Face name, GGUFTensor, shape in Hugging Face's order, row order or None) of
        every tensor the model has (llama.cpp's q/k permutation: the rows that undo it)."""
        config = self.config()
        permuted = _ARCHITECTURES[self.arch][2]
        for name, hf, tensor in _expanded(self.tensors, self.arch):
            if hf is None:
                if name.startswith("rope_freqs"):
                    continue
                raise GGUFError(f"GGUF tensor {name!r} has no place in the model")
            shape = tuple(reversed(tensor.shape))
            order = None
            if permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in hf else config.num_key_value_heads
                order = unpermute_rows(shape[0], heads)
            yield hf, tensor, shape, order

    def quantized_projections(self) -> list[tuple[str, str]]:
        """(GGUF name, block type) of the layer projections stored in a block type, not a float."""
        found = {name: tensor.tensor_type.name for name, hf, tensor in _expanded(self.tensors, self.arch)
                 if tensor.tensor_type not in _FLOAT_TYPES and _PROJECTION.match(hf or "")}
        return list(found.items())

    def check_types(self) -> dict[str, list[str]]:
        """Refuse, naming the tensor and its type, a tensor no path serves: neither the native
        kernels (`native_types`) nor a dequantization (models/quantization/ggml.py, gguf-py's).
        Returns the block types the native kernels lack -> their tensors, which are served dense
        through torch (the loader says so in one line); empty unless the native kernels serve."""
        servable: dict[GGMLQuantizationType, bool] = {}
        lacking: dict[str, list[str]] = {}
        for name, tensor in self.tensors.items():
            qtype = tensor.tensor_type
            if qtype in _FLOAT_TYPES or int(qtype) in self.native_types:
                continue
            if qtype not in servable:
                servable[qtype] = _dequantizable(qtype)
            if not servable[qtype]:
                raise GGUFError(f"tensor {name!r} has block type {qtype.name}, which neither the native "
                                "kernels nor the torch path (dequantized) serve")
            if self.native_types:
                lacking.setdefault(qtype.name, []).append(name)
        return lacking

    def iter_tensors(self, int4_names: set[str], skip: set[str] = frozenset()) -> Iterator[tuple[str, object]]:
        """(Hugging Face name, DenseTensor, GGUFBlocks or Int4Groups) for every tensor the model has
        but those in `skip`; names in `int4_names` come quantized (`int4_names`)."""
        for hf, tensor, shape, order in self._named():
            if hf in skip:
                continue
            if hf in int4_names and int(tensor.tensor_type) in self.native_types:
                blocks = GGUFBlocks(np.asarray(tensor.data), int(tensor.tensor_type), shape)
                yield hf, blocks if order is None else blocks.rows(order)
            elif hf in int4_names:
                groups = ggml.int4_groups(np.asarray(tensor.data), tensor.tensor_type, shape)
                yield hf, groups if order is None else groups.rows(order)
            else:
                yield hf, DenseTensor(tensor.data, tensor.tensor_type, shape, order)

    def iter_sliced(self, shard) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 slice) of every tensor for one tensor-parallel rank:
        `shard(name, shape, read)` is models/parallel.py's ShardPlan.slice, and `read(index)`
        dequantizes only the blocks the slice covers (gguf_slice.py)."""
        for hf, tensor, shape, order in self._named():
            yield hf, shard(hf, shape, functools.partial(read_slice, tensor, shape, order))

    def close(self) -> None:
        """Drop the memory map; unmapped now unless weights are served on the file's blocks (then
        it goes with the last of them)."""
        self.header.close(unmap=not self.native_types)


def gguf_eos_token_ids(tokenizer) -> list[int]:
    """The file's eos, plus `<|endoftext|>` where the vocabulary has it (ChatML models such as
    SmolLM2 end a chat turn with `<|im_end|>` and a document with `<|endoftext|>`)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    end_of_text = tokenizer.get_vocab().get("<|endoftext|>")
    if end_of_text is not None and end_of_text not in ids:
        ids.append(end_of_text)
    return ids
