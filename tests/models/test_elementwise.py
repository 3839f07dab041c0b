"""Elementwise functions over whole vectors (models/layers/elementwise.py): a row's activations and
soft-capped logits have the bits it gets alone, whatever the rows beside it and the thread count.
torch's loops do a run's last values in scalar code (other bits from `exp`) and cut long runs
between threads, so without the padding rows differ (float32 silu: 2-15 rows of 300 on 5 and 7
threads)."""

from __future__ import annotations

import pytest
import torch

from opentgi.models.layers.elementwise import (
    ACTIVATIONS,
    VECTOR_RUN,
    elementwise_on_padded_copy,
    vector_aligned_length,
)

torch.set_num_threads(1)


@pytest.fixture
def threads():
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


@pytest.mark.parametrize("num_threads", [1, 2, 5, 7])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gate_rows_activation_is_its_alone_at_any_batch_size(act, dtype, num_threads, threads):
    threads(num_threads)
    gen = torch.Generator().manual_seed(0)
    fn = ACTIVATIONS[act]
    for intermediate in (4864, 1000):  # whole steps a row, and not
        gate_up = torch.randn(300, 2 * intermediate, generator=gen).to(dtype)
        alone = [fn(gate_up[r:r + 1].split(intermediate, dim=-1)[0]) for r in range(300)]
        for rows in (1, 3, 5, 37, 150, 300):
            together = fn(gate_up[:rows].split(intermediate, dim=-1)[0])
            for r in range(rows):
                assert torch.equal(together[r:r + 1], alone[r]), (intermediate, rows, r)


@pytest.mark.parametrize("num_threads", [1, 2, 5, 7])
def test_a_sigmoid_on_a_padded_copy_gives_each_row_its_bits_alone(num_threads, threads):
    threads(num_threads)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(120, 1000, generator=gen).bfloat16()  # 1000 logits a row: no whole steps

    def capped(x):
        return elementwise_on_padded_copy(x, lambda run: run.mul_(0.1).sigmoid_(), dtype=torch.float32)

    alone = torch.cat([capped(logits[r:r + 1]) for r in range(120)])
    for rows in (33, 120):
        assert torch.equal(capped(logits[:rows]), alone[:rows]), rows
    torch.testing.assert_close(capped(logits), torch.sigmoid(logits.float() * 0.1))


@pytest.mark.parametrize("n", [1, 127, 128, 32767, 32768, 40000, 98304, 250001])
@pytest.mark.parametrize("num_threads", [1, 2, 3, 5, 16])
def test_the_padded_run_cuts_into_whole_steps_as_torch_shares_it(n, num_threads):
    """at::parallel_for: k = min(threads, ceil(n / grain)) shares of ceil(n / k) values, with grain
    32768 (most ops) or n // threads (gelu past 16,384 values)."""
    length = vector_aligned_length(n, num_threads)
    assert n <= length < n + VECTOR_RUN * num_threads * num_threads
    for grain in (32768, max(1, length // num_threads)):
        shares = 1 if length < grain or num_threads == 1 else min(num_threads, -(-length // grain))
        assert (-(-length // shares)) % VECTOR_RUN == 0 and length % VECTOR_RUN == 0
