"""Dense weights on the native kernels (kernels/csrc/dense.cpp: float32, float16 and bfloat16 rows
by the same ops as GGUF blocks): within float32 rounding of the exact product, the same bits on every
instruction set (AVX-512 BF16's dot products included, where the CPU has them), alone or among other
rows, on any thread count; and a mixture of experts' dense experts run grouped on them."""

from __future__ import annotations

import os

import pytest
import torch

from opentgi.config import Settings
from opentgi.kernels import native
from opentgi.models.layers.moe import GroupedExperts, SparseMoE
from opentgi.models.loader import load_model
from opentgi.models.quantization.linear import QuantizedLinear
from tests.helpers import tiny_models
from tests.helpers.moe import per_expert
from tests.helpers.paged import PagedRunner

torch.set_num_threads(1)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COUNTS = (1, 2, 3, 4, 5, 6, 7, 9, 16, 17, 33)


def _weight(dtype: torch.dtype, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5).to(dtype)
    return w, w.view(torch.uint8).reshape(n, -1)


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_rows_are_within_float32_rounding_of_the_exact_product(kernels, dtype, x_dtype):
    """Each output a float32 sum (16 lanes of K / 16 fused multiply-adds, then 4 adds): within
    (K / 16 + 4) * 2**-24 of the products' absolute sum; bfloat16 rows' outputs then rounded once."""
    w, raw = _weight(dtype, 40, 576, seed=1)
    x = _x(7, 576, x_dtype, seed=2)
    exact = x.double() @ w.double().T
    bound = (576 / 16 + 4) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    if x_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    for isa in native.supported_isas():
        got = native.gguf_mm(x, raw, native.DENSE_TYPE_OF[dtype], 40, isa)
        assert got.dtype == x_dtype and got.shape == (7, 40)
        assert ((got.double() - exact).abs() <= bound).all(), isa


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_instruction_set_gives_the_same_bits(kernels, dtype, x_dtype):
    """The scalar, AVX2 and AVX-512 variants (for bfloat16 weights by bfloat16 rows on a CPU with
    AVX-512 BF16: its dot-product instruction) compute one order of operations."""
    w, raw = _weight(dtype, 72, 1024, seed=3)
    x = _x(19, 1024, x_dtype, seed=4)
    results = [native.gguf_mm(x, raw, native.DENSE_TYPE_OF[dtype], 72, isa) for isa in native.supported_isas()]
    for isa, got in zip(native.supported_isas()[1:], results[1:], strict=True):
        assert torch.equal(got, results[0]), isa


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_dense_row_keeps_its_bits_whatever_shares_its_step_and_the_thread_count(kernels, dtype, x_dtype):
    w, raw = _weight(dtype, 53, 256, seed=5)  # 53 outputs: strips of 8, 4 and single outputs
    x = _x(40, 256, x_dtype, seed=6)
    qtype = native.DENSE_TYPE_OF[dtype]
    threads = torch.get_num_threads()
    try:
        for isa in native.supported_isas():
            whole = native.gguf_mm(x, raw, qtype, 53, isa)
            for count in COUNTS:
                for start in range(0, 40 - count + 1, max(count, 7)):
                    assert torch.equal(native.gguf_mm(x[start:start + count], raw, qtype, 53, isa),
                                       whole[start:start + count]), (isa, count, start)
            for count in range(2, max(2, os.cpu_count() or 1) + 2):
                torch.set_num_threads(count)
                assert torch.equal(native.gguf_mm(x, raw, qtype, 53, isa), whole), (isa, count)
            torch.set_num_threads(1)
    finally:
        torch.set_num_threads(threads)


def test_dense_shapes_the_kernel_cannot_take_are_refused(kernels):
    _, raw = _weight(torch.bfloat16, 8, 48, seed=7)
    with pytest.raises(RuntimeError, match="K=48 is not a multiple of 32"):
        native.gguf_mm(_x(2, 48, torch.float32, 8), raw, native.DENSE_TYPE_OF[torch.bfloat16], 8)
    _, raw = _weight(torch.float16, 8, 64, seed=7)
    with pytest.raises(RuntimeError, match="holding 9 rows"):
        native.gguf_mm(_x(2, 64, torch.float32, 8), raw, native.DENSE_TYPE_OF[torch.float16], 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_in_dense_weights_or_rows_never_crash(kernels, dtype):
    w, _ = _weight(dtype, 16, 64, seed=9)
    w[3, 5], w[7, 0] = float("nan"), float("inf")
    raw = w.view(torch.uint8).reshape(16, -1)
    x = _x(3, 64, torch.float32, seed=10)
    x[1, 9] = float("inf")
    for isa in native.supported_isas():
        got = native.gguf_mm(x, raw, native.DENSE_TYPE_OF[dtype], 16, isa)
        assert got[:, 3].isnan().all() and not got[0].isfinite().all()
        assert got[0, :3].isfinite().all()


HIDDEN, INTERMEDIATE, EXPERTS = 128, 96, 8


def _dense_block(dtype: torch.dtype, top_k: int = 2) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(HIDDEN, INTERMEDIATE, EXPERTS, top_k, True, "silu", ("gate_proj", "up_proj", "down_proj"))
    block = block.to(dtype).eval()
    with torch.no_grad():
        block.gate.weight.mul_(20)
    block.native = True  # the native kernels serve the model: dense experts move onto them
    block.fuse_projections()
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_run_grouped_with_the_per_expert_paths_bits(kernels, dtype):
    """Dense experts become the kernels' dense rows (the same bytes): grouped, a token's bits
    alone are its bits among others and the per-expert loop's (float32: the batched loop's too;
    bfloat16's batched loop adds through `index_add_`, within its roundings); and the result is the
    plain torch block's within float rounding."""
    block = _dense_block(dtype)
    assert isinstance(block.grouped, GroupedExperts)
    expert = block.experts[0]
    assert isinstance(expert.gate_up_proj, QuantizedLinear) and isinstance(expert.down_proj, QuantizedLinear)
    name = {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype]
    assert expert.gate_up_proj.weight_format.description.startswith(f"{name} rows")
    x = _x(21, HIDDEN, dtype, seed=11)
    with torch.inference_mode():
        got = block(x)
        for t in (0, 7, 20):
            assert torch.equal(block(x[t:t + 1]), got[t:t + 1])
            assert torch.equal(per_expert(block, x[t:t + 1]), got[t:t + 1])
        if dtype == torch.float32:
            assert torch.equal(per_expert(block, x), got)
        torch.manual_seed(0)
        reference = SparseMoE(HIDDEN, INTERMEDIATE, EXPERTS, 2, True, "silu",
                              ("gate_proj", "up_proj", "down_proj")).to(dtype).eval()
        with torch.no_grad():
            reference.gate.weight.mul_(20)
        reference.fuse_projections()  # not `native`: dense experts stay torch's linears, one by one
        assert reference.grouped is None
        want = reference(x)
    scale = want.float().abs().amax(dim=-1, keepdim=True)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert ((got.float() - want.float()).abs() <= tol * scale).all()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_dense_moe_checkpoint_on_the_native_kernels_runs_its_experts_grouped(kernels, family, tmp_path):
    """A tiny bfloat16 Qwen3-MoE / Mixtral folder with --kernels native: its experts run grouped on
    their dense rows, and its logits are the torch path's (--kernels torch) within rounding."""
    torch.set_num_threads(1)
    path = str(tiny_models.tiny_family_path(family))

    def logits(kernels_mode: str):
        loaded = load_model(Settings(model_id=path, dtype="bfloat16", kernels=kernels_mode, cache_dir=str(tmp_path)))
        blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
        runner = PagedRunner(loaded.model)
        with torch.inference_mode():
            steps = [loaded.model.compute_logits(runner.step({0: [5, 9, 200, 31, 7, 64], 1: [3, 3, 17]}))]
            steps.append(loaded.model.compute_logits(runner.step({0: [11], 1: [12]})))
        return blocks, steps

    blocks, native_steps = logits("native")
    assert blocks and all(isinstance(b.grouped, GroupedExperts) for b in blocks)
    assert "BF16 rows" in blocks[0].experts[0].down_proj.weight_format.description
    torch_blocks, torch_steps = logits("torch")
    assert all(b.grouped is None for b in torch_blocks)
    for got, want in zip(native_steps, torch_steps, strict=True):
        assert torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1).min() > 0.99


def test_bfloat16_sums_that_cancel_keep_one_order_on_every_path(kernels):
    """bfloat16 weights: each output's last two products cancel what came before to ~2**-18 of it,
    so the float32 sum's last bits show in its bfloat16 rounding: bfloat16 rows (AVX-512 BF16's dot
    products where the CPU has them) give the bits of float32 rows of the same values (fused
    multiply-adds) rounded, on every path, in tiles of one row and of several."""
    k, n = 1024, 64
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    x[0, -2:] = 1.0
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    head = (x[0, :-2].double() * w[:, :-2].double()).sum(dim=1)  # row 0's sum before the last two
    w[:, -1] = (-head).to(torch.bfloat16)
    w[:, -2] = (-(head + w[:, -1].double())).to(torch.bfloat16)
    raw = w.view(torch.uint8).reshape(n, -1)
    qtype = native.DENSE_TYPE_OF[torch.bfloat16]
    for rows in (x[:1], x):
        want = native.gguf_mm(rows.float(), raw, qtype, n, "scalar").to(torch.bfloat16)
        assert (want[0].abs() < 2.0 ** -8 * x[0].float().abs() @ w.float().abs().T).all()  # they cancel
        for isa in native.supported_isas():
            assert torch.equal(native.gguf_mm(rows, raw, qtype, n, isa), want), isa
            assert torch.equal(native.gguf_mm(rows.float(), raw, qtype, n, isa).to(torch.bfloat16), want), isa
