"""Fusing quantized weights concatenates them on one thread (models/quantization/single_thread_cat.py)."""

from __future__ import annotations

import torch

from opentgi.models.quantization import rtn
from opentgi.models.quantization.int4 import Int4Weight
from opentgi.models.quantization.int8 import Int8Weight


def _spy_on_cat(monkeypatch) -> list[int]:
    seen: list[int] = []
    cat = torch.cat

    def spying_cat(tensors, dim=0):
        seen.append(torch.get_num_threads())
        return cat(tensors, dim)

    monkeypatch.setattr(torch, "cat", spying_cat)
    return seen


def test_fusing_int4_and_int8_weights_copies_on_one_thread_and_restores_the_count(monkeypatch):
    torch.set_num_threads(2)
    try:
        w = [torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        int4 = [Int4Weight(rtn.int4_groups(x, 32), torch.bfloat16, torch.device("cpu")) for x in w]
        int8 = [rtn.int8_rows(x).to_format(torch.bfloat16, torch.device("cpu")) for x in w]
        want4 = (torch.cat([p.packed for p in int4]), torch.cat([p.scales_and_zeros for p in int4], dim=1))
        seen = _spy_on_cat(monkeypatch)
        fused4 = Int4Weight.cat(int4)
        fused8 = Int8Weight.cat(int8)
        assert seen and all(n == 1 for n in seen)
        assert torch.get_num_threads() == 2
        assert torch.equal(fused4.packed, want4[0]) and torch.equal(fused4.scales_and_zeros, want4[1])
        assert torch.equal(fused8.q, torch.cat([p.q for p in int8])) and fused8.out_features == 192
    finally:
        torch.set_num_threads(1)
