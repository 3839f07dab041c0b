"""AWQ and GPTQ checkpoints written by hand from a tiny Llama: each layer projection packed in the
method's layout, beside a float checkpoint holding the same (dequantized) weights."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from opentgi.models.quantization.awq_gptq import AWQ_PACK_ORDER
from tests.helpers import tiny_models

GROUP = 32


def asymmetric_int4(w: torch.Tensor, group: int):
    """q [N, K], z [N, K / group] (0..15) and fp16-exact s [N, K / group]: w ~ (q - z) * s."""
    n, k = w.shape
    groups = w.view(n, k // group, group)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    z = (-lo / s).round().clamp(0, 15)
    q = (groups / s[..., None]).round().add(z[..., None]).clamp(0, 15)
    return q.view(n, k).long(), z.long(), s


def pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...]: value j in bits 4j..4j+3."""
    words = (nibbles.long() << (4 * torch.arange(8))).sum(-1).numpy().astype(np.uint32)
    return torch.from_numpy(words.view(np.int32))


def gptq_tensors(q, z, s, group, zero_offset=1):
    n, k = q.shape
    return {"qweight": pack_words(q.T.reshape(k // 8, 8, n).transpose(1, 2)),  # [K/8, N]
            "qzeros": pack_words((z.T - zero_offset).reshape(k // group, n // 8, 8)),  # [K/g, N/8]
            "scales": s.T.half().contiguous(),
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def awq_tensors(q, z, s):
    order = torch.tensor(AWQ_PACK_ORDER)
    n, k = q.shape
    return {"qweight": pack_words(q.T.reshape(k, n // 8, 8)[..., order]),  # [K, N/8]
            "qzeros": pack_words(z.T.reshape(-1, n // 8, 8)[..., order]),
            "scales": s.T.half().contiguous()}


def write_packed(tmp_path, method: str, qconfig_extra: dict | None = None):
    """(the packed checkpoint, a float checkpoint with its dequantized weights)."""
    base = tiny_models.tiny_llama_path()
    packed_dir, float_dir = tmp_path / method, tmp_path / f"{method}-float"
    for out in (packed_dir, float_dir):
        shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors", ".complete"))
    state = load_file(base / "model.safetensors")
    packed, dense = {}, {}
    for name, tensor in state.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            q, z, s = asymmetric_int4(tensor, GROUP)
            prefix = name[: -len(".weight")]
            parts = awq_tensors(q, z, s) if method == "awq" else gptq_tensors(q, z, s, GROUP)
            packed.update({f"{prefix}.{leaf}": value for leaf, value in parts.items()})
            dense[name] = ((q - z.repeat_interleave(GROUP, 1)) * s.repeat_interleave(GROUP, 1)).float()
        else:
            packed[name] = dense[name] = tensor
    save_file(packed, packed_dir / "model.safetensors")
    save_file(dense, float_dir / "model.safetensors")
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": GROUP,
                                     **({"version": "gemm", "zero_point": True} if method == "awq"
                                        else {"desc_act": False, "sym": False}), **(qconfig_extra or {})}
    (packed_dir / "config.json").write_text(json.dumps(config))
    return packed_dir, float_dir
