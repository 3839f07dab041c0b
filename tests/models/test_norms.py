"""The decoder's RMSNorm gives Hugging Face's bits (transformers' LlamaRMSNorm)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from opentgi.models.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_matches_hugging_faces_bit_for_bit(dtype, threads):
    gen = torch.Generator().manual_seed(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, size in ((1, 576), (17, 576), (300, 2048), (5, 64)):
            theirs = LlamaRMSNorm(size, eps=1e-5)
            ours = RMSNorm(size, eps=1e-5)
            weight = torch.randn(size, generator=gen)
            theirs.weight.data.copy_(weight)
            ours.weight.data.copy_(weight)
            theirs.to(dtype), ours.to(dtype)
            # rows of very different scales, as hidden states have
            x = (torch.randn(rows, size, generator=gen) * torch.logspace(-2, 3, rows).unsqueeze(1)).to(dtype)
            with torch.inference_mode():
                assert torch.equal(ours(x), theirs(x)), (rows, size)
                assert ours(x[:1]).equal(ours(x)[:1])
    finally:
        torch.set_num_threads(previous)
