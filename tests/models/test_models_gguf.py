"""GGUF files read as they are (models/checkpoints/gguf_checkpoint.py): config and tokenizer from
the file's metadata, 4-bit blocks into the int4 kernel's layout, other blocks dense; the logits
match transformers' own (dequantizing) GGUF import; nothing is converted on disk."""

from __future__ import annotations

import functools
import re
import threading

import pytest
import torch

from opentgi.config import Settings
from opentgi.kernels import native
from opentgi.models.checkpoints.gguf_checkpoint import GGUFCheckpoint, unpermute_rows
from opentgi.models.checkpoints.gguf_header import GGUFHeader
from opentgi.models.layers.linear import OneDNNLinear, RowTiledLinear
from opentgi.models.loader import ModelLoadError, load_model
from opentgi.models.quantization.linear import ConcatLinear, QuantizedLinear
from tests.helpers import tiny_models
from tests.helpers.cpu_kernels import int4_projections, int4_weights_stack
from tests.helpers.paged import PagedRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_gguf():
    return tiny_models.tiny_gguf_path()


@functools.lru_cache(maxsize=1)
def _transformers_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _reference_logits(path, prompt):
    """transformers' own forward of its GGUF import (the last file's import kept)."""
    with torch.no_grad():
        return _transformers_model(path)(torch.tensor([prompt])).logits[0]


def test_config_comes_from_the_metadata(tiny_gguf):
    config = GGUFCheckpoint(tiny_gguf).config()
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size) == (256, 2, 4, 2, 512)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 10000.0 and config.max_position_embeddings == 4096


def test_unpermute_rows_undoes_llama_cpp_permutation():
    """llama.cpp's convert script: w.reshape(heads, 2, dim/heads/2, ...).swapaxes(1, 2)."""
    heads, rows = 4, 32
    original = torch.arange(rows)
    permuted = original.view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    assert torch.equal(permuted[unpermute_rows(rows, heads)], original)


@pytest.mark.slow  # transformers' GGUF import, three times
def test_the_reference_import_reads_the_gguf_once_and_builds_the_same_model(tiny_gguf, monkeypatch):
    """load_transformers_model: one gguf-py reader for transformers' two passes over the file, the
    same weights as transformers' own import (which opens it twice), gguf-py left as it was."""
    import gguf
    from transformers import AutoModelForCausalLM

    from opentgi.models.loader import load_transformers_model

    opened = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            opened.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    ours = load_transformers_model(tiny_gguf)
    assert len(opened) == 1 and gguf.GGUFReader is Counting
    plain = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    assert len(opened) == 3
    theirs = plain.state_dict()
    assert ours.state_dict().keys() == theirs.keys()
    assert all(torch.equal(value, theirs[name]) for name, value in ours.state_dict().items())


@pytest.mark.slow  # the ci tier: a long run
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_gguf_serves_its_formats_and_matches_transformers(tiny_gguf, gguf_cache, dtype):
    loaded = load_model(Settings(model_id=str(tiny_gguf), dtype=dtype, cache_dir=str(gguf_cache)))
    assert loaded.kind == "paged" and loaded.eos_token_ids == [2, 0]
    layer = loaded.model.model.layers[0]
    # q (Q4_0) and k (Q4_1) are int4, v (Q6_K) dense: run side by side; gate (Q4_K) + up (Q4_1): one
    # int4 weight; o (Q4_K) int4; down (Q5_K) dense
    assert isinstance(layer.self_attn.qkv_proj, ConcatLinear)
    # (stacked where torch's int4 layout on this CPU is the one the product stacks: int4_weights_stack)
    gate_up = int4_projections(layer.mlp.gate_up_proj)
    assert len(gate_up) == (1 if int4_weights_stack() else 2) and all(isinstance(p, QuantizedLinear) for p in gate_up)
    assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
    assert {p.weight_format.description for p in gate_up} == {"int4 (groups of 32)"}
    assert not isinstance(layer.mlp.down_proj, QuantizedLinear)
    assert "int4 (groups of 32)" in loaded.model.resident
    # nothing converted to floats: the cache holds the tokenizer and, on CPU, the packed 4-bit
    # layers, together smaller than the file
    cached = sum(p.stat().st_size for p in gguf_cache.rglob("*") if p.is_file())
    assert cached < tiny_gguf.stat().st_size / 2
    prompt = loaded.tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    want = _reference_logits(tiny_gguf, prompt)[-1]
    got = loaded.model.compute_logits(PagedRunner(loaded.model).step({0: prompt}))[0]
    # the int4 kernel runs in bfloat16 in both (float32 rows converted: int4.kernel_dtype)
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99


def test_a_broken_gguf_is_refused_clearly(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(Settings(model_id=str(bad), cache_dir=str(tmp_path)))


@pytest.mark.slow
def test_default_model_is_read_from_its_gguf(default_model):
    """No --model-id: SmolLM2-135M-Instruct's GGUF read as it is; the logits agree with
    transformers' own GGUF import (float32), and a second start reuses the cached tokenizer."""

    loaded = default_model(dtype="float32")
    assert loaded.kind == "paged" and loaded.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert loaded.eos_token_ids == [2, 0] and loaded.tokenizer.eos_token == "<|im_end|>"
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                                  add_generation_prompt=True)
    with torch.no_grad():
        want = default_model.transformers()(torch.tensor([prompt])).logits[0, -1]
    paged = loaded.model.compute_logits(PagedRunner(loaded.model).step({0: prompt}))[0]
    # float32, the int4 layers' rows through torch's kernel as bfloat16 (int4.kernel_dtype)
    assert torch.nn.functional.cosine_similarity(paged, want, dim=0) > 0.999
    assert paged.argmax() == want.argmax()
    again = load_model(Settings(cache_dir=default_model.cache_dir, dtype="float32"))
    assert again.tokenizer(["Hello world"])["input_ids"] == loaded.tokenizer(["Hello world"])["input_ids"]


def test_a_second_start_reads_the_packed_layers_from_the_cache(tiny_gguf, gguf_cache, monkeypatch):
    from opentgi.models.quantization import ggml

    first = load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", cache_dir=str(gguf_cache)))
    packed = list((gguf_cache / "packed").glob("*.safetensors"))
    assert len(packed) == 1 and packed[0].stat().st_size <= tiny_gguf.stat().st_size

    def no_decoding(*args):
        raise AssertionError("a cached layer was decoded again")

    monkeypatch.setattr(ggml, "int4_groups", no_decoding)
    second = load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", cache_dir=str(gguf_cache)))
    prompt = first.tokenizer("Hello there, general")["input_ids"]
    logits = [m.model.compute_logits(PagedRunner(m.model).step({0: prompt}))[0] for m in (first, second)]
    assert torch.equal(logits[0], logits[1])
    assert second.model.resident == first.model.resident


def test_a_dense_tensor_is_never_dequantized_whole_into_its_weight(tiny_gguf, gguf_cache, monkeypatch):
    """The embedding (49152 x 256) and the dense layers go into their weights a chunk of rows at a
    time: no float32 copy of a whole tensor beside its weight at start-up; the same model."""
    from opentgi.models.quantization import ggml

    prompt = [1, 504, 3113, 28, 2823]
    whole = load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", cache_dir=str(gguf_cache)))
    monkeypatch.setattr(ggml, "DENSE_CHUNK_BYTES", 64 << 10)  # 64 rows of the embedding at once
    rows = []
    dense = ggml.dense
    monkeypatch.setattr(ggml, "dense", lambda raw, qtype, shape: rows.append(shape[0]) or dense(raw, qtype, shape))
    chunked = load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", cache_dir=str(gguf_cache)))
    assert len(rows) > 49152 // 64 and max(rows) <= 256  # 1-D norms whole (256 values); 2-D in chunks
    logits = [m.model.compute_logits(PagedRunner(m.model).step({0: prompt}))[0] for m in (whole, chunked)]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.slow  # the ci tier: a long run
def test_a_large_tied_head_keeps_one_copy(tiny_gguf, gguf_cache, monkeypatch):
    """A tied LM head above TIED_HEAD_COPY_MAX_BYTES multiplies by the embedding itself (no oneDNN
    copy: the native dense rows on the embedding's own bytes where the kernels are loaded, else
    F.linear row-tiled over its storage), with the same logits up to summation order."""
    from opentgi.models.families import decoder

    small = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(gguf_cache)))
    monkeypatch.setattr(decoder, "TIED_HEAD_COPY_MAX_BYTES", 1 << 20)
    large = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(gguf_cache)))
    assert isinstance(small.model.logits_proj, OneDNNLinear)
    head = large.model.logits_proj  # the embedding's own storage, not a copy
    if native.loaded() is not None:
        assert type(head) is QuantizedLinear and head.weight_format.qtype in native.DENSE_TYPES
        stored = head.weight_format.blocks
    else:
        assert isinstance(head, RowTiledLinear)
        stored = head.weight
    assert stored.data_ptr() == large.model.model.embed_tokens.weight.data_ptr()

    def total_mib(model) -> int:
        return int(re.search(r"total ([\d,]+) MiB", model.resident).group(1).replace(",", ""))

    assert total_mib(large.model) == total_mib(small.model) - 48  # 49152 x 256 float32
    hidden = torch.randn(3, 256)
    torch.testing.assert_close(large.model.compute_logits(hidden), small.model.compute_logits(hidden),
                               atol=1e-4, rtol=1e-4)


def test_dequantize_serves_every_layer_dense(tiny_gguf, gguf_cache):
    """--dequantize: the 4-bit layers in the serving dtype (oneDNN on CPU), the same weights."""
    kept = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(gguf_cache)))
    dense = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", cache_dir=str(gguf_cache), dequantize=True))
    assert not any(isinstance(m, QuantizedLinear) for m in dense.model.modules())
    assert "int4" not in dense.model.resident
    prompt = kept.tokenizer("Once upon a time")["input_ids"]
    got, want = (m.model.compute_logits(PagedRunner(m.model).step({0: prompt}))[0] for m in (dense, kept))
    # the kept int4 layers multiply float32 rows as bfloat16 (int4.kernel_dtype)
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999


@pytest.mark.slow  # the ci tier: a long run
def _small_vocab_gguf(path, kind: str):
    """A GGUF holding only a tokenizer of a few hundred tokens (transformers' import of a 49k one
    takes 15 s): "gpt2", byte-level BPE with merges (a Qwen2 file), or "llama", sentencepiece
    pieces with scores and byte fallback (a Llama file)."""
    import gguf
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    writer = gguf.GGUFWriter(str(path), "qwen2" if kind == "gpt2" else "llama")
    writer.add_context_length(64)
    if kind == "gpt2":
        chars = list(bytes_to_unicode().values())
        merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
        tokens = chars + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        types = [1] * (len(tokens) - 3) + [3, 3, 3]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(merges)
        writer.add_bos_token_id(len(tokens) - 2)
        writer.add_eos_token_id(len(tokens) - 1)
        writer.add_add_bos_token(False)
    else:
        pieces = ["▁the", "▁a", "▁world", "▁w", "or", "ld", "he", "in", "▁", "t", "h", "e", "a", "w", "o", "r", "l", "d"]
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
        types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_tokenizer_is_the_one_transformers_gguf_import_builds(kind, tmp_path, monkeypatch):
    """The token lists read by our header reader and handed to transformers' converter give the
    tokenizer transformers' own GGUF import builds (backend, class, specials, template), for a
    byte-level BPE and a sentencepiece file; and `load_gguf_tokenizer` builds the same whether it
    takes that path or falls back to the import."""
    from transformers import AutoTokenizer

    from opentgi.models.checkpoints import gguf_tokenizer

    path = _small_vocab_gguf(tmp_path / f"{kind}.gguf", kind)
    header = GGUFHeader(path)
    converted = gguf_tokenizer._converted(header)
    header.close()
    imported = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, legacy=True)
    assert converted.backend_tokenizer.to_str() == imported.backend_tokenizer.to_str()
    assert type(converted) is type(imported)
    assert converted.special_tokens_map == imported.special_tokens_map
    assert converted.chat_template == imported.chat_template
    text = "the world in a wörld\n 12 \t😀"
    assert converted(text)["input_ids"] == imported(text)["input_ids"]

    served = gguf_tokenizer.load_gguf_tokenizer(path)

    def refuse(header):
        raise KeyError("a converter input this file lacks")

    monkeypatch.setattr(gguf_tokenizer, "_converted", refuse)
    fallback = gguf_tokenizer.load_gguf_tokenizer(path)
    assert served.backend_tokenizer.to_str() == fallback.backend_tokenizer.to_str()
    assert served.special_tokens_map == fallback.special_tokens_map
    assert served.decode(served(text)["input_ids"], skip_special_tokens=True).strip() == text.strip()


def test_the_header_reader_agrees_with_gguf_py(tiny_gguf):
    """gguf_header.py's one-pass reader: the same scalar metadata, arrays and tensor bytes as
    gguf-py's GGUFReader."""
    import gguf
    import numpy as np


    header, reader = GGUFHeader(tiny_gguf), gguf.GGUFReader(str(tiny_gguf))
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert header.array_lengths[key] == len(field.data), key
            assert header.array(key) == field.contents(), key
        elif not key.startswith("GGUF."):
            assert header.fields[key] == field.contents(), key
    assert set(header.tensors) == {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        ours = header.tensors[tensor.name]
        assert ours.tensor_type == tensor.tensor_type and ours.shape == tuple(int(d) for d in tensor.shape)
        assert np.array_equal(ours.data, tensor.data), tensor.name
    header.close()


def test_quantize_int8_on_a_gguf_requantizes_every_projection(tiny_gguf, gguf_cache):
    loaded = load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", quantize="int8", cache_dir=str(gguf_cache)))
    kinds = {m.weight_format.kind for m in loaded.model.modules() if isinstance(m, QuantizedLinear)}
    assert kinds == {"int8"} and "int8 (per channel)" in loaded.model.resident
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and isinstance(layer.mlp.down_proj, QuantizedLinear)


def test_the_packed_cache_reader_reads_what_safetensors_wrote(tmp_path):
    from safetensors.torch import save_file

    from opentgi.models.checkpoints.packed_cache import read_safetensors

    tensors = {"a.packed": torch.arange(300, dtype=torch.int32).reshape(3, 100),
               "a.scales": torch.randn(7, 5, 2).to(torch.bfloat16), "a.group_size": torch.tensor(32),
               "b": torch.zeros(0, 4, dtype=torch.uint8)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    got = read_safetensors(tmp_path / "t.safetensors")
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())
    assert got["a.packed"].untyped_storage().data_ptr() != got["a.scales"].untyped_storage().data_ptr()
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="ends inside"):
        read_safetensors(tmp_path / "cut.safetensors")


def test_the_packed_cache_writer_writes_what_safetensors_reads(tmp_path):
    """A tensor at a time from its own memory (no whole-file copy), read back by safetensors itself
    and by the cache's reader."""
    from safetensors.torch import load_file

    from opentgi.models.checkpoints.packed_cache import read_safetensors, write_safetensors

    tensors = {"a.packed": torch.arange(300, dtype=torch.int32).reshape(3, 100),
               "a.scales": torch.randn(7, 5, 2).to(torch.bfloat16), "a.group_size": torch.tensor(32),
               "b": torch.zeros(0, 4, dtype=torch.uint8), "c": torch.randn(4, 6)[:, ::2]}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    for got in (load_file(str(tmp_path / "t.safetensors")), read_safetensors(tmp_path / "t.safetensors")):
        assert got.keys() == tensors.keys()
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())


def test_the_packed_cache_is_read_in_a_thread_while_the_header_loads(tiny_gguf, gguf_cache, monkeypatch):
    from opentgi.models.checkpoints import packed_cache

    load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", cache_dir=str(gguf_cache)))  # writes it
    threads = []
    read = packed_cache.read_safetensors

    def reading(path):
        threads.append(threading.current_thread().name)
        return read(path)

    monkeypatch.setattr(packed_cache, "read_safetensors", reading)
    second = load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", cache_dir=str(gguf_cache)))
    assert len(threads) == 1 and threads[0].startswith("opentgi-packed-cache")
    assert "int4" in second.model.resident
    load_model(Settings(model_id=str(tiny_gguf), dtype="bfloat16", cache_dir=str(gguf_cache), dequantize=True))
    assert len(threads) == 1  # layers served dense: the cache is not read
