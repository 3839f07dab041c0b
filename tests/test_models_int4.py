"""Weights already on a 4-bit grid (a GGUF Q4_1 checkpoint) served from their 4-bit form for small
steps (models/quantization/int4.py): found exactly and only where they are, multiplied like the dense
weights, used only for steps of at most the measured row count, and not at all where the kernel is
not faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opentgi.config import Settings
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.models import loader
from opentgi.models.layers.linear import OneDNNLinear
from opentgi.models.quantization import int4
from opentgi.models.quantization.int4 import (
    Int4Grid,
    Int4Switch,
    Int4Weight,
    find_int4_grid,
    int4_rows_worth_it,
)
from tests import tiny_models
from tests.engine_helpers import generate, running
from tests.test_models_llama import PagedRunner

torch.set_num_threads(1)


def q4_weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return tiny_models.q4_1_round_trip(torch.randn(n, k, generator=gen) * 0.05)


def weights_of(grid: Int4Grid) -> torch.Tensor:
    """The float32 weights the grid stands for: lo + d * k, group by group."""
    n, k = grid.k.shape
    groups = grid.k.view(n, k // 32, 32).float()
    return (grid.lo[..., None] + grid.d[..., None] * groups).view(n, k)


def test_grid_of_a_q4_1_weight_gives_back_every_weight_exactly():
    weight = q4_weight()
    grid = find_int4_grid(weight)
    assert grid is not None
    assert grid.k.dtype == torch.uint8 and int(grid.k.max()) == 15 and int(grid.k.min()) == 0
    assert torch.equal(weights_of(grid), weight)


def test_weights_off_the_grid_have_none():
    assert find_int4_grid(torch.randn(64, 64)) is None
    nudged = q4_weight()
    nudged[5, 70] += 1e-4
    assert find_int4_grid(nudged) is None
    assert find_int4_grid(q4_weight(k=128)[:, :48]) is None  # 48 inputs: not whole groups of 32
    assert find_int4_grid(torch.zeros(4, 32, dtype=torch.int64)) is None
    assert find_int4_grid(q4_weight().bfloat16()) is None  # only float32 holds the grid exactly
    off_after_the_sample = q4_weight()
    off_after_the_sample[50, 3] += 1e-4
    assert find_int4_grid(off_after_the_sample) is None


def test_a_constant_group_lies_on_the_grid():
    weight = q4_weight()
    weight[3, 32:64] = 0.25
    grid = find_int4_grid(weight)
    assert grid is not None and torch.equal(weights_of(grid), weight)


def test_stacked_grids_are_the_grid_of_the_stacked_weights():
    a, b = q4_weight(32, seed=1), q4_weight(64, seed=2)
    stacked = Int4Grid.cat([find_int4_grid(a), find_int4_grid(b)])
    assert torch.equal(weights_of(stacked), torch.cat([a, b]))


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_matmul_is_the_dense_product_up_to_bfloat16_rounding(rows):
    weight = q4_weight()
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.inference_mode():
        got = Int4Weight(find_int4_grid(weight)).matmul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, weight.shape[0])
    want = F.linear(x.float(), weight)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_uses_its_4bit_copy_only_while_the_switch_is_on(monkeypatch, bias):
    weight = q4_weight()
    b = torch.randn(weight.shape[0]).bfloat16() if bias else None
    linear = OneDNNLinear(weight.bfloat16(), b)
    linear.int4, linear.int4_switch = Int4Weight(find_int4_grid(weight)), Int4Switch()
    used = []
    real = Int4Weight.matmul
    monkeypatch.setattr(Int4Weight, "matmul", lambda self, x: used.append(x.shape[0]) or real(self, x))
    x = torch.ones(3, weight.shape[1], dtype=torch.bfloat16)
    want = F.linear(x.float(), weight, None if b is None else b.float())
    with torch.inference_mode():
        dense = linear(x)
        linear.int4_switch.on = True
        packed = linear(x)
    assert used == [3]
    for out in (dense, packed):
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=2e-2)


def fake_timings(monkeypatch, ratio_by_rows: dict[int, float]):
    """`_measure` reporting int4 time = ratio * dense time, per probed row count."""
    monkeypatch.setattr(int4, "_measure", lambda linears, rows, repeats: (1.0, ratio_by_rows[rows]))


def test_the_probe_keeps_the_row_counts_where_the_4bit_kernel_is_clearly_faster(monkeypatch):
    linear = OneDNNLinear(q4_weight().bfloat16())
    fake_timings(monkeypatch, {1: 0.3, 2: 0.5, 4: 0.85, 8: 0.3})
    assert int4_rows_worth_it([linear]) == 2
    fake_timings(monkeypatch, {1: 0.9, 2: 0.5, 4: 0.5, 8: 0.5})
    assert int4_rows_worth_it([linear]) == 0
    assert int4_rows_worth_it([]) == 0


def test_the_probe_gives_up_when_the_kernel_fails(monkeypatch):
    linear = OneDNNLinear(q4_weight().bfloat16())
    linear.int4 = Int4Weight(find_int4_grid(q4_weight()))

    def broken(self, x):
        raise RuntimeError("no int4 kernel in this build")

    monkeypatch.setattr(Int4Weight, "matmul", broken)
    assert int4_rows_worth_it([linear]) == 0


def test_the_probe_times_the_real_kernels():
    linear = OneDNNLinear(q4_weight().bfloat16())
    linear.int4 = Int4Weight(find_int4_grid(q4_weight()))
    assert int4_rows_worth_it([linear], repeats=1) in (0, 1, 2, 4, 8)


def load_bfloat16(path, monkeypatch, ratio: float, nondeterministic: bool = True):
    """The 4-bit copies serve steps of a few rows only with --nondeterministic (docs/determinism.md)."""
    fake_timings(monkeypatch, {1: ratio, 2: ratio, 4: ratio, 8: 1.0})
    settings = Settings(model_id=str(path), dtype="bfloat16", nondeterministic=nondeterministic)
    return loader.load_model(settings).model


def layer_linears(model) -> list[OneDNNLinear]:
    return [lin for layer in model.model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                        layer.mlp.down_proj)]


def test_a_q4_checkpoint_in_bfloat16_gets_4bit_copies_that_agree_with_its_dense_weights(monkeypatch):
    model = load_bfloat16(tiny_models.tiny_q4_llama_path(), monkeypatch, ratio=0.3)
    assert model.int4_max_rows == 4
    assert all(lin.int4 is not None and lin.int4_switch is model.int4_switch for lin in layer_linears(model))
    prompts = {0: [5, 17, 300, 42, 7], 1: [9, 11]}

    def greedy_logits(use_int4: bool):
        runner, steps = PagedRunner(model), []
        model.use_int4_for(7, generated_only=False)
        assert not model.int4_switch.on  # prompt tokens: the dense weights
        hidden = runner.step(prompts)
        for _ in range(6):
            logits = model.compute_logits(hidden)
            steps.append(logits)
            model.use_int4_for(2, generated_only=use_int4)
            assert model.int4_switch.on is use_int4
            hidden = runner.step({seq: [int(logits[i].argmax())] for i, seq in enumerate(prompts)})
        return steps

    for a, b in zip(greedy_logits(True), greedy_logits(False), strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    model.use_int4_for(5, generated_only=True)
    assert not model.int4_switch.on  # more rows than the probe found worth it
    model.cover_int4_rows(5)
    model.use_int4_for(5, generated_only=True)
    assert model.int4_switch.on


async def test_a_request_computes_the_same_with_and_without_a_prefix_cache_hit(monkeypatch):
    """Prompt tokens always take the dense weights: a prompt whose uncached tail is a few tokens
    long (a prefix-cache hit) rounds as the whole prompt did, so greedy tokens and their logprobs
    repeat exactly; the decode steps took the 4-bit copies both times."""
    fake_timings(monkeypatch, {1: 0.3, 2: 0.3, 4: 0.3, 8: 1.0})
    loaded = loader.load_model(Settings(model_id=str(tiny_models.tiny_q4_llama_path()), dtype="bfloat16",
                                        nondeterministic=True))
    model = loaded.model
    switched = []
    use = model.use_int4_for
    monkeypatch.setattr(model, "use_int4_for", lambda n, g: switched.append((n, g)) or use(n, g))
    prompt = list(range(200, 218))  # one cached block of 16, then a tail of 2
    request = GenerationRequest(prompt, SamplingParams(), StoppingParams(max_new_tokens=12))
    async with running(loaded) as engine:
        first = (await generate(engine, request)).sequences[0]
        second = (await generate(engine, request)).sequences[0]
    assert (2, False) in switched  # the cached run's prompt tail, dense
    assert (1, True) in switched  # decode steps, 4-bit
    assert second.token_ids == first.token_ids
    assert [t.logprob for t in second.tokens] == [t.logprob for t in first.tokens]


def test_batch_invariant_serving_makes_no_4bit_copies(monkeypatch):
    """By default a generated row must not change kernel with the step's row count, and the 4-bit
    kernel is the faster one only for a few rows: the dense weights serve every row."""
    model = load_bfloat16(tiny_models.tiny_q4_llama_path(), monkeypatch, ratio=0.3, nondeterministic=False)
    assert model.int4_max_rows == 0
    assert all(lin.int4 is None and lin.int4_switch is None for lin in layer_linears(model))
    model.cover_int4_rows(5)
    assert model.int4_max_rows == 0


def test_no_4bit_copies_where_the_kernel_is_not_faster_or_the_weights_are_dense(monkeypatch):
    slow = load_bfloat16(tiny_models.tiny_q4_llama_path(), monkeypatch, ratio=0.95)
    assert slow.int4_max_rows == 0
    assert all(lin.int4 is None and lin.int4_switch is None for lin in layer_linears(slow))
    dense = load_bfloat16(tiny_models.tiny_llama_path(), monkeypatch, ratio=0.3)
    assert dense.int4_max_rows == 0 and dense.model.layers[0].mlp.down_proj.int4 is None


def test_float32_serves_the_q4_checkpoint_from_its_dense_weights(monkeypatch):
    fake_timings(monkeypatch, {1: 0.3, 2: 0.3, 4: 0.3, 8: 0.3})
    model = loader.load_model(Settings(model_id=str(tiny_models.tiny_q4_llama_path()), dtype="float32")).model
    assert model.int4_max_rows == 0 and model.model.layers[0].mlp.down_proj.int4 is None
