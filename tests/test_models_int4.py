"""Weights already on a 4-bit grid (a GGUF Q4_1 checkpoint) served from their 4-bit form for small
steps (models/layers/int4.py): found exactly and only where they are, multiplied like the dense
weights, used only for steps of at most the measured row count, and not at all where the kernel is
not faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opentgi.config import Settings
from opentgi.models import loader
from opentgi.models.layers import int4
from opentgi.models.layers.int4 import Int4Grid, Int4Weight, find_int4_grid, int4_rows_worth_it
from opentgi.models.layers.linear import OneDNNLinear
from tests import tiny_models
from tests.test_models_llama import PagedRunner

torch.set_num_threads(1)


def q4_weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return tiny_models.q4_1_round_trip(torch.randn(n, k, generator=gen) * 0.05)


def test_grid_of_a_q4_1_weight_gives_back_every_weight_exactly():
    weight = q4_weight()
    grid = find_int4_grid(weight)
    assert grid is not None
    assert grid.k.dtype == torch.uint8 and int(grid.k.max()) == 15 and int(grid.k.min()) == 0
    assert torch.equal(grid.dequantize(), weight)


def test_weights_off_the_grid_have_none():
    assert find_int4_grid(torch.randn(64, 64)) is None
    nudged = q4_weight()
    nudged[5, 70] += 1e-4
    assert find_int4_grid(nudged) is None
    assert find_int4_grid(q4_weight(k=128)[:, :48]) is None  # 48 inputs: not whole groups of 32
    assert find_int4_grid(torch.zeros(4, 32, dtype=torch.int64)) is None


def test_a_constant_group_lies_on_the_grid():
    weight = q4_weight()
    weight[3, 32:64] = 0.25
    grid = find_int4_grid(weight)
    assert grid is not None and torch.equal(grid.dequantize(), weight)


def test_stacked_grids_are_the_grid_of_the_stacked_weights():
    a, b = q4_weight(32, seed=1), q4_weight(64, seed=2)
    stacked = Int4Grid.cat([find_int4_grid(a), find_int4_grid(b)])
    assert torch.equal(stacked.dequantize(), torch.cat([a, b]))


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
def test_onednn_linear_uses_its_4bit_copy_only_up_to_int4_max_rows(monkeypatch, bias):
    weight = q4_weight()
    b = torch.randn(weight.shape[0]).bfloat16() if bias else None
    linear = OneDNNLinear(weight.bfloat16(), b)
    linear.int4 = Int4Weight(find_int4_grid(weight))
    linear.int4_max_rows = 2
    used = []
    real = Int4Weight.matmul
    monkeypatch.setattr(Int4Weight, "matmul", lambda self, x: used.append(x.shape[0]) or real(self, x))
    with torch.inference_mode():
        outputs = {rows: linear(torch.ones(rows, weight.shape[1], dtype=torch.bfloat16)) for rows in (1, 2, 3)}
    assert used == [1, 2]
    want = F.linear(torch.ones(1, weight.shape[1]), weight, None if b is None else b.float())
    for out in outputs.values():
        torch.testing.assert_close(out[:1].float(), want, atol=3e-2, rtol=2e-2)


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


def load_bfloat16(path, monkeypatch, ratio: float):
    fake_timings(monkeypatch, {1: ratio, 2: ratio, 4: ratio, 8: 1.0})
    return loader.load_model(Settings(model_id=str(path), dtype="bfloat16")).model


def test_a_q4_checkpoint_in_bfloat16_gets_4bit_copies_that_agree_with_its_dense_weights(monkeypatch):
    model = load_bfloat16(tiny_models.tiny_q4_llama_path(), monkeypatch, ratio=0.3)
    assert model.int4_max_rows == 4
    linears = [lin for layer in model.model.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)]
    assert all(lin.int4 is not None and lin.int4_max_rows == 4 for lin in linears)
    prompts = {0: [5, 17, 300, 42, 7], 1: [9, 11]}

    def greedy_logits():
        runner, steps = PagedRunner(model), []
        hidden = runner.step(prompts)  # prefill: 7 rows, the dense weights
        for _ in range(6):
            logits = model.compute_logits(hidden)
            steps.append(logits)
            hidden = runner.step({seq: [int(logits[i].argmax())] for i, seq in enumerate(prompts)})
        return steps

    with_int4 = greedy_logits()
    for lin in linears:
        lin.int4_max_rows = 0
    dense = greedy_logits()
    for a, b in zip(with_int4, dense, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


def test_no_4bit_copies_where_the_kernel_is_not_faster_or_the_weights_are_dense(monkeypatch):
    slow = load_bfloat16(tiny_models.tiny_q4_llama_path(), monkeypatch, ratio=0.95)
    assert slow.int4_max_rows == 0 and slow.model.layers[0].mlp.down_proj.int4 is None
    dense = load_bfloat16(tiny_models.tiny_llama_path(), monkeypatch, ratio=0.3)
    assert dense.int4_max_rows == 0 and dense.model.layers[0].mlp.down_proj.int4 is None


def test_float32_serves_the_q4_checkpoint_from_its_dense_weights(monkeypatch):
    fake_timings(monkeypatch, {1: 0.3, 2: 0.3, 4: 0.3, 8: 0.3})
    model = loader.load_model(Settings(model_id=str(tiny_models.tiny_q4_llama_path()), dtype="float32")).model
    assert model.int4_max_rows == 0 and model.model.layers[0].mlp.down_proj.int4 is None
