"""Bad GGUF input (models/checkpoints/gguf_header.py, gguf_checkpoint.py): a truncated or corrupt
file fails before serving with the tensor named; a block type no path serves is refused by name,
one the native kernels lack is served dense through torch with one line saying so; NaN or Inf
scales in blocks give NaN/Inf outputs in their own rows only, on the native kernel and the torch
path, never a crash."""

from __future__ import annotations

import logging
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from opentgi.config import Settings
from opentgi.models.checkpoints.gguf_checkpoint import GGUFCheckpoint, GGUFError
from opentgi.models.checkpoints.gguf_header import GGUFHeader
from opentgi.models.loader import ModelLoadError, load_model
from tests.helpers import tiny_models
from tests.helpers.gguf_blocks import F16_FIELDS, random_blocks, rows

torch.set_num_threads(1)

TENSORS = (("blk.0.attn_q.weight", Q.Q4_0, 64, 64), ("blk.0.attn_k.weight", Q.Q8_0, 32, 64),
           ("blk.0.ffn_down.weight", Q.Q4_K, 64, 256))


def small_gguf(path, tensors=TENSORS):
    """A GGUF with a few tensors of random blocks (no model: the header's checks need none)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for i, (name, qtype, n, k) in enumerate(tensors):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = random_blocks(qtype, n, k, seed=i) if qtype in F16_FIELDS else np.zeros((n, k // block * size), np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patched(path, tensor: str, part: int, value: int):
    """Overwrite one field of a tensor's header entry in place (gguf-py's reader, opened r+):
    part -1 its data offset, -2 its type id, 3 its dimensions (the first one)."""
    reader = gguf.GGUFReader(str(path), "r+")
    entry = next(t for t in reader.tensors if t.name == tensor)
    entry.field.parts[part][0] = value
    reader.data.flush()
    del reader
    return path


def offset_of(path, tensor: str) -> int:
    return int(next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor).field.parts[-1][0])


def test_a_well_formed_small_file_reads(tmp_path):
    header = GGUFHeader(small_gguf(tmp_path / "ok.gguf"))
    assert [header.tensors[name].shape for name, *_ in TENSORS] == [(64, 64), (64, 32), (256, 64)]
    header.close()


def test_a_truncated_file_names_the_tensor_past_the_end(tmp_path):
    path = small_gguf(tmp_path / "cut.gguf")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_down.weight' \(Q4_K, shape \[256, 64\].*runs past the "
                                         r"end of the file.*truncated or corrupt"):
        GGUFHeader(path)


def test_an_offset_past_the_end_names_the_tensor(tmp_path):
    path = patched(small_gguf(tmp_path / "far.gguf"), "blk.0.attn_q.weight", -1, 1 << 30)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight'.*runs past the end"):
        GGUFHeader(path)


def test_misaligned_data_names_the_tensor(tmp_path):
    path = small_gguf(tmp_path / "shifted.gguf")
    patched(path, "blk.0.attn_k.weight", -1, offset_of(path, "blk.0.attn_k.weight") + 2)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_k.weight'.*not a multiple of the file's alignment 32"):
        GGUFHeader(path)


def test_a_size_that_disagrees_with_shape_and_type_names_the_tensor(tmp_path):
    # Q4_0 (18 bytes a block of 32) read as Q8_0 (34 bytes): it runs into the next tensor's data
    path = patched(small_gguf(tmp_path / "retyped.gguf"), "blk.0.attn_q.weight", -2, int(Q.Q8_0))
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight' \(Q8_0.*overlaps tensor 'blk.0.attn_k.weight'"):
        GGUFHeader(path)
    # rows of 48 values are not whole Q4_0 blocks
    path = patched(small_gguf(tmp_path / "reshaped.gguf"), "blk.0.attn_q.weight", 3, 48)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight' \(Q4_0, shape \[48, 64\]\): 48 values a row "
                                         r"are not a whole number of Q4_0 blocks of 32"):
        GGUFHeader(path)


def test_an_unknown_type_id_names_the_tensor(tmp_path):
    path = patched(small_gguf(tmp_path / "alien.gguf"), "blk.0.attn_k.weight", -2, 99)
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_k.weight' has GGML type id 99, which is unknown"):
        GGUFHeader(path)


def test_a_type_no_path_serves_is_refused_by_name(tmp_path):
    path = small_gguf(tmp_path / "q8_1.gguf", TENSORS + (("blk.0.ffn_up.weight", Q.Q8_1, 32, 64),))
    checkpoint = GGUFCheckpoint(path)
    with pytest.raises(GGUFError, match="tensor 'blk.0.ffn_up.weight' has block type Q8_1, which neither the "
                                        "native kernels nor the torch path"):
        checkpoint.check_types()
    checkpoint.close()


def test_a_truncated_model_fails_before_serving(tmp_path):
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(tiny_models.tiny_gguf_path(), cut)
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 4096)
    with pytest.raises(ModelLoadError, match=r"cannot load GGUF file .*tensor 'blk.1.ffn_down.weight'.*past the end"):
        load_model(Settings(model_id=str(cut), cache_dir=str(tmp_path)))


def test_a_type_the_native_kernels_lack_is_listed_for_the_torch_path(tmp_path):
    from opentgi.models.quantization.gguf_blocks import NATIVE_TYPES

    path = small_gguf(tmp_path / "tq2.gguf", TENSORS + (("blk.0.ffn_up.weight", Q.TQ2_0, 32, 256),))
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.check_types() == {}  # the torch path serves every tensor
    checkpoint.native_types = NATIVE_TYPES
    assert checkpoint.check_types() == {"TQ2_0": ["blk.0.ffn_up.weight"]}  # gguf-py dequantizes it
    checkpoint.close()


def test_a_layer_type_the_native_kernels_lack_is_served_through_torch_with_one_line(gguf_cache, caplog, monkeypatch):
    """The tiny GGUF with Q5_K (its down projections) taken from the native kernels' types."""
    from opentgi.models.quantization import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "NATIVE_TYPES", gguf_blocks.NATIVE_TYPES - {int(Q.Q5_K)})
    with caplog.at_level(logging.INFO, logger="opentgi.models.loader"):
        loaded = load_model(Settings(model_id=str(tiny_models.tiny_gguf_path()), kernels="native", dtype="float32",
                                     cache_dir=str(gguf_cache)))
    lines = [r.getMessage() for r in caplog.records if "native kernels lack" in r.getMessage()]
    assert lines == ["GGUF: tensors of block types the native kernels lack are served dense through torch: "
                     "Q5_K (2 tensors, e.g. blk.0.ffn_down.weight)"]
    layer = loaded.model.model.layers[0]
    assert loaded.kernels.startswith("native") and layer.self_attn.o_proj.weight_format.kind == "gguf"
    assert not hasattr(layer.mlp.down_proj, "weight_format")  # dense
    from tests.helpers.paged import PagedRunner

    hidden = PagedRunner(loaded.model).step({0: [1, 504, 3113, 28]})
    assert torch.isfinite(loaded.model.compute_logits(hidden)).all()


def _poisoned(qtype: Q, n: int, k: int) -> np.ndarray:
    """Random blocks with row 0's first scale NaN and row 1's +Inf."""
    raw = random_blocks(qtype, n, k, seed=3)
    start = F16_FIELDS[qtype][0]
    for row, value in ((0, np.nan), (1, np.inf)):
        raw[row, start:start + 2] = np.array([value], np.float16).view(np.uint8)
    return raw


def _check_poisoned_rows(out: torch.Tensor, clean: torch.Tensor) -> None:
    assert out.shape == clean.shape
    assert not torch.isfinite(out[:, :2]).all()  # the poisoned rows say so
    torch.testing.assert_close(out[:, 2:], clean[:, 2:])  # the others are untouched
    assert torch.isfinite(out[:, 2:]).all()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0])
def test_nan_and_inf_scales_never_crash_the_native_kernel(qtype):
    from opentgi.kernels import native

    native.load("native")
    n, k = 8, 256
    raw, x = _poisoned(qtype, n, k), rows(3, k)
    clean = native.gguf_mm(x, torch.from_numpy(random_blocks(qtype, n, k, seed=3)), int(qtype), n)
    _check_poisoned_rows(native.gguf_mm(x, torch.from_numpy(raw), int(qtype), n), clean)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K])
def test_nan_and_inf_scales_never_crash_the_torch_path(qtype):
    """Q4_0 / Q4_K through torch's int4 kernel (Int4Groups), Q6_K dequantized dense."""
    from opentgi.models.quantization import ggml

    n, k = 16, 256  # torch's int4 packing takes rows in 16s
    raw, x = _poisoned(qtype, n, k), rows(3, k)

    def product(blocks):
        if qtype in ggml.INT4_TYPES:
            weight = ggml.int4_groups(blocks, qtype, (n, k)).to_format(torch.bfloat16, torch.device("cpu"))
            return weight.matmul(x.to(torch.bfloat16)).float()
        return x @ ggml.dense(blocks, qtype, (n, k)).T

    clean = product(random_blocks(qtype, n, k, seed=3))
    out = product(raw)
    assert out.shape == clean.shape
    assert not torch.isfinite(out[:, :2]).all()
    assert torch.equal(out[:, 2:], clean[:, 2:]) and torch.isfinite(out[:, 2:]).all()
