"""The routed-experts block (models/layers/moe.py) on its own: the checkpoints' routing, its
router's row invariance, and a lone token's path giving the bits the batched path gives it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opentgi.models.layers.moe import RouterLogits, SparseMoE
from tests.helpers.cpu_kernels import serve_linears

HIDDEN, INTERMEDIATE = 64, 96
NAMES = ("gate_proj", "up_proj", "down_proj")


def _block(dtype: torch.dtype, experts: int = 4, top_k: int = 3, renormalize: bool = True) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(HIDDEN, INTERMEDIATE, experts, top_k, renormalize, "silu", NAMES).to(dtype).eval()
    with torch.no_grad():
        block.gate.weight.mul_(20)  # router logits far from uniform, as trained routers give
    return block


def _textbook(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Routing and combination as transformers' Mixtral / Qwen3-MoE blocks write them (float32)."""
    probs = F.softmax(F.linear(x, block.gate.weight), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, block.top_k, dim=-1)
    if block.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t].tolist(), strict=True):
            mlp = block.experts[e]
            out[t] += w * mlp.down_proj(F.silu(mlp.gate_proj(x[t])) * mlp.up_proj(x[t]))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_block_matches_the_checkpoints_routing_in_float32(renormalize):
    block = _block(torch.float32, renormalize=renormalize)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = _textbook(block, x)
        block.fuse_projections()
        for rows in (x, x[:1]):  # the batched path and a lone token's
            torch.testing.assert_close(block(rows), expected[:rows.shape[0]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_takes_no_matmul_kernel_and_gives_a_row_the_same_bits_for_every_row_count(dtype):
    """The router's logits are per-row float32 sums (RouterLogits), not a oneDNN call: the row's
    bits do not depend on how many rows the step routes, and they are a linear layer's logits."""
    block = _block(dtype)
    weight = block.gate.weight.detach().clone()
    block.fuse_projections()
    serve_linears(block, dtype)
    assert isinstance(block.gate, RouterLogits)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        logits = block.gate(x)
        assert logits.dtype == dtype
        torch.testing.assert_close(logits.float(), F.linear(x.float(), weight.float()).to(dtype).float(),
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
        for count in (1, 2, 3, 5, 16, 17):
            for start in range(0, 64 - count + 1, count):
                assert torch.equal(block.gate(x[start:start + count]), logits[start:start + count])


def test_router_bounds_its_products_and_keeps_each_rows_bits():
    """A long prompt's router products are formed a few rows at a time (a 128-expert model over
    thousands of tokens would hold gigabytes at once), with the bits of all rows at once."""
    weight = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(3))
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole, bounded = RouterLogits(weight), RouterLogits(weight, temp_bytes=3 * 8 * HIDDEN * 4)
    assert whole.rows_at_once >= 50 and bounded.rows_at_once == 3
    calls = []
    forward = bounded.forward  # the module's calls go straight into forward (models/base.py, ForwardWithoutHooks)

    def counted(x):
        calls.append(x.shape[0])
        return forward(x)

    bounded.forward = counted
    with torch.inference_mode():
        assert torch.equal(bounded(x), whole(x))
    assert calls[0] == 50 and max(calls[1:]) == 3 and sum(calls[1:]) == 50  # the whole call, then its 17 parts


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_token_gets_the_bits_the_batched_path_gives_it(dtype, top_k):
    """A lone token's path (no sort, no scatter) must add its k expert outputs as the batched
    `index_add_` does: 3 of 4 experts a token, whose float32 sum depends on its order, and 2 (one
    add in the model dtype)."""
    block = _block(dtype, top_k=top_k)
    block.fuse_projections()
    serve_linears(block, dtype)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.inference_mode():
        full = block(x)
        for t in range(x.shape[0]):
            assert torch.equal(block(x[t:t + 1]), full[t:t + 1])
        for start in range(0, 40, 7):
            assert torch.equal(block(x[start:start + 7]), full[start:start + 7])
