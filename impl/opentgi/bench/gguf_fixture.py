"""A random Llama-shaped GGUF with the default model's tokenizer, for benchmarks and tests.

`python -m opentgi.bench write-gguf OUT.gguf` writes the Llama-1B-shaped file the side-by-side
comparison with llama.cpp uses (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192;
Q4_1 layers, Q8_0 embedding, tied head; 717 MB, about a minute). Weights are seeded normal
values times 0.02, quantized by gguf-py's `quantize` and written by its `GGUFWriter`; the
tokenizer (SmolLM2's, vocabulary 49152) is copied from the default model's GGUF metadata. Block
types gguf-py cannot quantize (the K-quants, IQ4_NL, IQ4_XS) are written as random blocks with
modest scales. `--layer-type` sets every layer projection's type (Q4_0, IQ4_XS, ...).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# byte offsets of the float16 scale fields of the block types written as random blocks
_RANDOM_BLOCK_F16 = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                     "IQ4_NL": (0,), "IQ4_XS": (0,)}


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    context: int = 8192
    rope_theta: float = 500000.0
    experts: int = 0  # > 0: routed experts (ffn_*_exps): a Mixtral, or a Qwen3-MoE with arch "qwen3moe"
    experts_used: int = 2
    arch: str = "llama"  # or "qwen3moe" (q/k norms, experts of `intermediate` features)


LLAMA_1B = LlamaShape()
# A Qwen3-30B-A3B-like mixture of experts at half its depth and half its experts: 24 layers, 64 experts
# of 768 features, 8 a token (~7.5B weights, ~1.1B a token), heads of 128
QWEN3_MOE_HALF = LlamaShape(layers=24, heads=16, kv_heads=4, intermediate=768, rope_theta=1000000.0, experts=64,
                            experts_used=8, arch="qwen3moe")
SHAPES = {"1b": LLAMA_1B, "qwen3-moe": QWEN3_MOE_HALF}


def _copy_tokenizer(writer, source: Path) -> int:
    """Copy the `tokenizer.*` metadata of `source`; returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    vocab = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                values = [field.parts[i][0].item() for i in field.data]
            writer.add_array(field.name, values)
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]][0].item(), kind)
    return vocab


def _random_blocks(rng, qtype, rows: int, columns: int) -> np.ndarray:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    for start in _RANDOM_BLOCK_F16[qtype.name]:
        scales = (np.abs(rng.standard_normal((rows, columns // block))) * 0.0005).astype(np.float16)
        raw[..., start:start + 2] = scales.view(np.uint8).reshape(rows, columns // block, 2)
    return raw.reshape(rows, -1)


def write_random_llama_gguf(out: str | Path, shape: LlamaShape = LLAMA_1B, layer_types: dict | None = None,
                            embedding_type: str = "Q8_0", seed: int = 0, tokenizer_gguf: Path | None = None,
                            progress=None) -> Path:
    """Write the file; `layer_types` maps a projection (attn_q, attn_k, attn_v, attn_output,
    ffn_gate, ffn_up, ffn_down) to a GGML type name (default Q4_1 for all)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from opentgi.models.checkpoints.default_model import default_gguf_path

    out = Path(out)
    types = {name: "Q4_1" for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    types.update(layer_types or {})
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    vocab = _copy_tokenizer(writer, tokenizer_gguf or default_gguf_path())
    head_dim = shape.hidden // shape.heads
    writer.add_name("random-llama")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        if shape.arch == "qwen3moe":
            writer.add_expert_feed_forward_length(shape.intermediate)

    def tensor(name: str, dims: tuple[int, ...], type_name: str | None) -> None:
        if type_name is None:  # a norm weight: float32 ones
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            return
        qtype = Q[type_name]
        if type_name in _RANDOM_BLOCK_F16:
            data = _random_blocks(rng, qtype, int(np.prod(dims[:-1])), dims[-1]).reshape(*dims[:-1], -1)
        else:
            data = gguf.quants.quantize(rng.standard_normal(dims, dtype=np.float32) * 0.02, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    h, kv = shape.hidden, shape.kv_heads * head_dim
    tensor("token_embd.weight", (vocab, h), embedding_type)
    tensor("output_norm.weight", (h,), None)
    for i in range(shape.layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", (h,), None)
        tensor(p + "ffn_norm.weight", (h,), None)
        if shape.arch == "qwen3moe":  # q/k norms over each head
            tensor(p + "attn_q_norm.weight", (head_dim,), None)
            tensor(p + "attn_k_norm.weight", (head_dim,), None)
        tensor(p + "attn_q.weight", (h, h), types["attn_q"])
        tensor(p + "attn_k.weight", (kv, h), types["attn_k"])
        tensor(p + "attn_v.weight", (kv, h), types["attn_v"])
        tensor(p + "attn_output.weight", (h, h), types["attn_output"])
        if shape.experts:  # the router in float32, each projection's experts stacked in one tensor
            writer.add_tensor(p + "ffn_gate_inp.weight",
                              rng.standard_normal((shape.experts, h), dtype=np.float32) * 0.5)
            tensor(p + "ffn_gate_exps.weight", (shape.experts, shape.intermediate, h), types["ffn_gate"])
            tensor(p + "ffn_up_exps.weight", (shape.experts, shape.intermediate, h), types["ffn_up"])
            tensor(p + "ffn_down_exps.weight", (shape.experts, h, shape.intermediate), types["ffn_down"])
        else:
            tensor(p + "ffn_gate.weight", (shape.intermediate, h), types["ffn_gate"])
            tensor(p + "ffn_up.weight", (shape.intermediate, h), types["ffn_up"])
            tensor(p + "ffn_down.weight", (h, shape.intermediate), types["ffn_down"])
        if progress is not None:
            progress(i + 1, shape.layers)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m opentgi.bench write-gguf",
                                     description="write a random Llama-1B-shaped GGUF (Q4_1 layers, Q8_0 "
                                                 "embedding, SmolLM2's tokenizer)")
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--layer-type", default="Q4_1", help="GGML type of every layer projection")
    parser.add_argument("--down-type", help="GGML type of the v and down projections (default: --layer-type; "
                                            "Q6_K with Q4_K layers: the Q4_K_M mix)")
    parser.add_argument("--embedding-type", default="Q8_0")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b",
                        help="1b: Llama-1B; qwen3-moe: a Qwen3-30B-A3B-like MoE at half its depth and experts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    layer_types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
                                args.layer_type)
    if args.down_type:
        layer_types.update(attn_v=args.down_type, ffn_down=args.down_type)
    path = write_random_llama_gguf(args.out, SHAPES[args.shape], layer_types=layer_types,
                                   embedding_type=args.embedding_type, seed=args.seed,
                                   progress=lambda i, n: print(f"layer {i}/{n}", flush=True))
    print(f"wrote {path} ({path.stat().st_size / 2**20:,.0f} MiB)")


if __name__ == "__main__":
    main()
