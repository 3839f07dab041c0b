"""Grouped experts on the native kernels (models/layers/moe.py's GroupedExperts, kernels'
gguf_moe_up/gguf_moe_down): one call per projection for every token and expert gives the bits of
the per-expert loop in float32, a token's bits alone or among others, on 1 or 2 threads, and bad
expert ids are refused."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from opentgi.config import Settings
from opentgi.kernels import native
from opentgi.models.attention.selector import select_backend
from opentgi.models.checkpoints.gguf_checkpoint import GGUFCheckpoint
from opentgi.models.layers.moe import GroupedExperts, SparseMoE
from opentgi.models.loader import load_model
from opentgi.models.quantization.gguf_blocks import NATIVE_TYPES, GGUFBlockWeight
from opentgi.models.quantization.linear import QuantizedLinear
from opentgi.models.registry import build_paged_model
from tests.helpers import tiny_models
from tests.helpers.gguf_blocks import random_blocks
from tests.helpers.moe import per_expert
from tests.helpers.paged import PagedRunner

HIDDEN, INTERMEDIATE, EXPERTS = 256, 256, 8
NAMES = ("gate_proj", "up_proj", "down_proj")


def _blocks_linear(qtype: Q, out_features: int, in_features: int, seed: int, passes: int) -> QuantizedLinear:
    linear = QuantizedLinear(in_features, out_features)
    blocks = torch.from_numpy(random_blocks(qtype, out_features, in_features, seed=seed))
    # as a GGUF's experts are: views of the file, which only the grouped kernel's fusing copies
    linear.weight_format = GGUFBlockWeight(blocks, int(qtype), in_features, passes, mapped=True)
    return linear


def _block(kernels, dtype: torch.dtype, qtype: Q = Q.Q4_K, down_type: Q = Q.Q6_K, top_k: int = 3,
           passes: int = 1) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(HIDDEN, INTERMEDIATE, EXPERTS, top_k, True, "silu", NAMES).to(dtype).eval()
    with torch.no_grad():
        block.gate.weight.mul_(20)
    for e, expert in enumerate(block.experts):
        expert.gate_proj = _blocks_linear(qtype, INTERMEDIATE, HIDDEN, 3 * e, passes)
        expert.up_proj = _blocks_linear(qtype, INTERMEDIATE, HIDDEN, 3 * e + 1, passes)
        expert.down_proj = _blocks_linear(down_type, HIDDEN, INTERMEDIATE, 3 * e + 2, passes)
    block.fuse_projections()
    assert isinstance(block.grouped, GroupedExperts)
    return block


def _rows(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(("qtype", "down_type", "passes"), [(Q.Q4_K, Q.Q6_K, 1), (Q.Q4_1, Q.Q8_0, 1),
                                                            (Q.Q4_K, Q.Q5_0, 2)])
def test_grouped_experts_give_the_per_expert_loops_bits_in_float32(kernels, qtype, down_type, passes):
    torch.set_num_threads(1)
    block = _block(kernels, torch.float32, qtype, down_type, passes=passes)
    x = _rows(13, torch.float32)
    with torch.inference_mode():
        for rows in (x, x[:1], x[:2]):  # the batched loop, and a lone token's own path
            assert torch.equal(block(rows), per_expert(block, rows))


@pytest.mark.parametrize("top_k", [2, 3])
def test_grouped_experts_in_bfloat16_stay_within_a_rounding_of_the_per_expert_loop(kernels, top_k):
    """bfloat16: each product rounded to bfloat16 and the k added in float32, rounded once (the
    lone token's loop path, bitwise); the batched loop's bfloat16 `index_add_` may round between
    its adds, so within two bfloat16 roundings of the result there."""
    torch.set_num_threads(1)
    block = _block(kernels, torch.bfloat16, top_k=top_k)
    x = _rows(11, torch.bfloat16)
    with torch.inference_mode():
        got, want = block(x), per_expert(block, x)
        for t in range(x.shape[0]):
            assert torch.equal(got[t:t + 1], per_expert(block, x[t:t + 1]))
    scale = want.float().abs().amax(dim=-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * scale).all()


def test_a_tokens_bits_do_not_depend_on_the_other_tokens_or_the_thread_count(kernels):
    """Each token alone, among others (routed to other experts), and on 1 or 2 threads."""
    block = _block(kernels, torch.float32, passes=2)
    x = _rows(24, torch.float32, seed=5)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            full = block(x)
            for start, count in ((0, 1), (5, 1), (3, 2), (7, 9), (20, 4)):
                assert torch.equal(block(x[start:start + count]), full[start:start + count])
            torch.set_num_threads(2)
            assert torch.equal(block(x), full)
            assert torch.equal(block(x[5:6]), full[5:6])
    finally:
        torch.set_num_threads(threads)


def test_the_grouped_ops_refuse_bad_expert_ids_and_shapes(kernels):
    torch.set_num_threads(1)
    block = _block(kernels, torch.float32)
    grouped = block.grouped
    x = _rows(2, torch.float32)
    up = grouped.gate_up_format
    with pytest.raises(RuntimeError, match="expert id 8 is not one of 8"):
        native.moe_up(x, grouped.gate_up, up.qtype, torch.tensor([[0, 8], [1, 2]]), up.out_features)
    with pytest.raises(RuntimeError, match="ids must be"):
        native.moe_up(x, grouped.gate_up, up.qtype, torch.tensor([[0, 1]]), up.out_features)
    h = torch.zeros(3, INTERMEDIATE)
    with pytest.raises(RuntimeError, match="a row per"):
        native.moe_down(h, grouped.down, grouped.down_format.qtype, torch.tensor([[0, 1], [1, 2]]),
                        torch.ones(2, 2), HIDDEN)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_moe_model_on_native_blocks_runs_grouped_and_computes_the_per_expert_paths_logits(
        kernels, family, tmp_path):
    """A tiny Qwen3-MoE / Mixtral with `--quantize int8` (Q8_0 blocks on the native kernels): its
    experts run grouped, and a prompt step and decode steps give the per-expert path's bits."""
    torch.set_num_threads(1)
    loaded = load_model(Settings(model_id=str(tiny_models.tiny_family_path(family)), dtype="float32",
                                 quantize="int8", kernels="native", cache_dir=str(tmp_path)))
    model = loaded.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(isinstance(b.grouped, GroupedExperts) for b in blocks)
    prompts = {0: [5, 9, 200, 31, 7, 64], 1: [3, 3, 17]}

    def run() -> list[torch.Tensor]:
        runner = PagedRunner(model)
        with torch.inference_mode():
            steps = [model.compute_logits(runner.step(prompts))]
            for token in (11, 42):
                steps.append(model.compute_logits(runner.step({0: [token], 1: [token + 1]})))
        return steps

    grouped = run()
    saved = [b.grouped for b in blocks]
    for b in blocks:
        b.grouped = None
    try:
        loop = run()
    finally:
        for b, g in zip(blocks, saved, strict=True):
            b.grouped = g
    for got, want in zip(grouped, loop, strict=True):
        assert torch.equal(got, want)


def _gguf_model(path, kernels: str):
    """The paged model of a GGUF as the loader builds it (no tokenizer: the test feeds token ids)."""
    checkpoint = GGUFCheckpoint(path)
    native_types = NATIVE_TYPES if kernels == "native" else frozenset()
    checkpoint.native_types = native_types
    backend = select_backend(torch.device("cpu"), torch.float32, kernels)
    return build_paged_model(checkpoint, checkpoint.config(), backend, torch.float32, torch.device("cpu"),
                             native_types=native_types)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_a_moe_gguf_runs_its_experts_grouped_on_the_files_blocks(kernels, arch):
    """llama.cpp's Mixtral and Qwen3-MoE layouts (stacked ffn_*_exps tensors): each expert a view of
    the file's blocks, run grouped; the per-expert path's bits, and the torch path's logits up to
    the activations' rounding."""
    torch.set_num_threads(1)
    path = tiny_models.tiny_moe_gguf_path(arch=arch)
    native_model, torch_model = _gguf_model(path, "native"), _gguf_model(path, "torch")
    assert type(native_model.config).__name__ == ("MixtralConfig" if arch == "llama" else "Qwen3MoeConfig")
    blocks = [m for m in native_model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == 2 and all(isinstance(b.grouped, GroupedExperts) for b in blocks)
    down = blocks[0].experts[1].down_proj.weight_format
    assert down.description.startswith("Q6_K") and down.passes == 2
    assert blocks[0].grouped.gate_up_format.description.startswith("Q4_K")
    prompt = {0: [5, 9, 200, 31, 7, 64, 1000, 3]}
    with torch.inference_mode():
        grouped = native_model.compute_logits(PagedRunner(native_model).step(prompt))
        for b in blocks:
            b.grouped = None
        loop = native_model.compute_logits(PagedRunner(native_model).step(prompt))
        reference = torch_model.compute_logits(PagedRunner(torch_model).step(prompt))
    assert torch.equal(grouped, loop)
    assert torch.nn.functional.cosine_similarity(grouped[0], reference[0], dim=0) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_native_routing_picks_the_torch_routes_experts_within_float_rounding(kernels, dtype, renormalize):
    """opentgi::moe_route (a block on the native kernels, `native`): the same top k experts as the
    torch route (logits far apart), their weights within float rounding; a token's bits alone."""
    block = _block(kernels, dtype)
    block.renormalize = renormalize
    x = _rows(9, dtype, seed=5)
    weights, experts = block.route(x)
    block.native = True
    native_weights, native_experts = block.route(x)
    assert native_experts.dtype == torch.long and native_weights.dtype == dtype
    assert torch.equal(native_experts, experts)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(native_weights, weights, **tol)
    for t in (0, 8):
        alone = block.route(x[t:t + 1])
        assert torch.equal(alone[0], native_weights[t:t + 1]) and torch.equal(alone[1], native_experts[t:t + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_gives_the_same_bits_on_every_isa(kernels, dtype):
    """moe_route's logits (sixteen running sums, then in order, then the tail: hidden 2056 has one)
    and so its experts and weights are the same on every ISA, and a token's alone."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 2056, generator=g).to(dtype)
    w = torch.randn(64, 2056, generator=g) * 0.05
    for renormalize in (True, False):
        routes = [native.moe_route(x, w, 8, renormalize, isa) for isa in native.supported_isas()]
        for weights, experts in routes[1:]:
            assert torch.equal(weights, routes[0][0]) and torch.equal(experts, routes[0][1]), renormalize
        alone = native.moe_route(x[4:5], w, 8, renormalize)
        assert torch.equal(alone[0], routes[0][0][4:5]) and torch.equal(alone[1], routes[0][1][4:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_the_activation_in_the_gate_up_call_gives_the_two_calls_bits(kernels, dtype, gelu_tanh):
    """moe_up with its activation (SiLU or GELU-tanh and multiply, [T * k, N / 2]) against moe_up
    then silu_mul / gelu_tanh_mul, on GGUF blocks and on dense bfloat16 rows, on every ISA."""
    block = _block(kernels, dtype)
    grouped = block.grouped
    up = grouped.gate_up_format
    x = _rows(13, dtype, seed=3)
    weights, experts = block.route(x)
    dense = [(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=torch.Generator().manual_seed(e)) * 0.05)
             .to(torch.bfloat16).view(torch.uint8).reshape(2 * INTERMEDIATE, -1) for e in range(EXPERTS)]
    separate = native.gelu_tanh_mul if gelu_tanh else native.silu_mul
    for blocks, qtype in ((grouped.gate_up, up.qtype), (dense, native.DENSE_TYPE_OF[torch.bfloat16])):
        for isa in native.supported_isas():
            two = separate(native.moe_up(x, blocks, qtype, experts, up.out_features, isa=isa), isa=isa)
            one = native.moe_up(x, blocks, qtype, experts, up.out_features, isa=isa, gelu_tanh=gelu_tanh)
            assert one.shape == (13 * 3, INTERMEDIATE) and one.dtype == dtype
            assert torch.equal(one, two.reshape(13 * 3, INTERMEDIATE)), isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_down_call_and_its_weighted_sum_give_the_same_bits_on_every_isa(kernels, dtype):
    """moe_down's products and their weighted sum (the row op's AVX2 and scalar forms) alike on
    every instruction set, for GGUF blocks and dense bfloat16 rows."""
    block = _block(kernels, dtype)
    grouped = block.grouped
    down = grouped.down_format
    x = _rows(11, dtype, seed=4)
    weights, experts = block.route(x)
    h = torch.randn(11 * 3, INTERMEDIATE, generator=torch.Generator().manual_seed(5)).to(dtype)
    dense = [(torch.randn(HIDDEN, INTERMEDIATE, generator=torch.Generator().manual_seed(e)) * 0.05)
             .to(torch.bfloat16).view(torch.uint8).reshape(HIDDEN, -1) for e in range(EXPERTS)]
    for blocks, qtype in ((grouped.down, down.qtype), (dense, native.DENSE_TYPE_OF[torch.bfloat16])):
        results = [native.moe_down(h, blocks, qtype, experts, weights, HIDDEN, isa=isa)
                   for isa in native.supported_isas()]
        for isa, got in zip(native.supported_isas()[1:], results[1:], strict=True):
            assert torch.equal(got, results[0]), isa
