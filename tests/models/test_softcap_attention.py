"""Soft-capped attention (Gemma 2) in the torch backend: the numbers of transformers' formula, and
the batch-invariance contract (docs/determinism.md): a row's bits depend neither on the rows
attended beside it nor on the masked keys its group pads it with, and a Gemma 2 request's tokens
and logprobs through the engine are those it gets alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from opentgi.config import Settings
from opentgi.models.attention import torch_backend
from opentgi.models.attention.softcap import capped_logits, softcapped_attention
from opentgi.models.loader import load_model
from tests.helpers import tiny_models
from tests.helpers.determinism import OTHERS, TARGET, run_target

torch.set_num_threads(1)


def transformers_formula(q, k, v, mask, scale, cap):
    """Gemma 2's eager attention: cap * tanh(s * scale / cap), the mask, a softmax (float64 here)."""
    s = torch.matmul(q.double(), k.double().transpose(-2, -1)) * scale
    s = torch.tanh(s / cap) * cap + mask.double()
    return torch.matmul(torch.softmax(s, dim=-1), v.double())


@pytest.mark.parametrize("rows", [3, 20])  # a decode row's query rows a kv head (sdpa), a prompt's
@pytest.mark.parametrize("keys", [40, 300])
def test_the_logits_are_soft_capped_as_transformers_does(keys, rows):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, rows, 64, generator=gen) * 4  # logits beyond the cap, where capping matters
    k, v = torch.randn(2, 4, 3, keys, 64, generator=gen)
    mask = torch.zeros(4, 1, 1, keys)
    mask[1, ..., keys // 2:] = float("-inf")
    want = transformers_formula(q, k, v, mask, 0.125, 5.0)
    torch.testing.assert_close(softcapped_attention(q, k, v, mask, 0.125, 5.0).double(), want, atol=1e-5, rtol=1e-5)
    bool_mask = mask == 0  # the bool form (prefill rows' causal masks)
    torch.testing.assert_close(softcapped_attention(q, k, v, bool_mask, 0.125, 5.0).double(), want, atol=1e-5, rtol=1e-5)
    # bfloat16: the matmuls in bfloat16, the rest in float32
    got = softcapped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16(), 0.125, 5.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.05)


@pytest.mark.slow  # the ci tier: a long run
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 4, 64), (2, 2, 16), (4, 2, 256)])
def test_a_rows_bits_do_not_depend_on_its_batch_or_its_key_padding(shape, dtype, threads):
    """As a decode group attends it: a row beside others, its keys padded with masked ones to the
    group's longest context in whole blocks. In float32 a row over 130 keys alone and padded to
    512 got other bits from one matmul over all keys, in bfloat16 over 700 keys and padded to 1040
    (hence the fixed key chunks: 128 keys in float32, 1,024 in bfloat16)."""
    num_kv_heads, group, head_dim = shape
    gen = torch.Generator().manual_seed(1)
    most = 2096
    keys = torch.randn(most, num_kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(most, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(1, num_kv_heads, group, head_dim, generator=gen) * 3).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for context in (5, 130, 257, 300, 700, 1030, 2050):
            def attend(length: int, batch: int) -> torch.Tensor:
                # [batch, kv_heads, length, D] views of [length, kv_heads, D] rows, as gathered
                k = keys[:length].unsqueeze(0).transpose(1, 2).expand(batch, -1, -1, -1)
                v = values[:length].unsqueeze(0).transpose(1, 2).expand(batch, -1, -1, -1)
                mask = torch.zeros(batch, 1, 1, length, dtype=dtype)
                mask[..., context:] = float("-inf")
                return softcapped_attention(q.expand(batch, -1, -1, -1), k, v, mask, head_dim ** -0.5, 2.0)[0]

            alone = attend(-(-context // 16) * 16, 1)
            for length in (-(-context // 16) * 16, 512, 528, 1040, 2096):
                for batch in (1, 2, 7):
                    if length >= context:
                        assert torch.equal(attend(length, batch), alone), (context, length, batch)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 4, 64), (2, 2, 16), (4, 2, 256)])
def test_a_bfloat16_rows_bits_do_not_depend_on_its_padding_past_1024_keys(shape, threads):
    """One bfloat16 matmul of the probabilities and values over all keys gives some of these rows
    other bits once the padded key count passes 1,024 (contexts of 752-1,024 keys at these caps);
    chunks of 1,024 keys do not."""
    num_kv_heads, group, head_dim = shape
    gen = torch.Generator().manual_seed(1)
    most = 2096
    keys = torch.randn(most, num_kv_heads, head_dim, generator=gen).bfloat16()
    values = torch.randn(most, num_kv_heads, head_dim, generator=gen).bfloat16()
    q = (torch.randn(1, num_kv_heads, group, head_dim, generator=gen) * 3).bfloat16()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for cap in (8.0, 30.0):
            for context in (752, 800, 1000, 1024, 1030, 2050):
                def attend(length: int) -> torch.Tensor:
                    k = keys[:length].unsqueeze(0).transpose(1, 2)
                    v = values[:length].unsqueeze(0).transpose(1, 2)
                    mask = torch.zeros(1, 1, 1, length, dtype=torch.bfloat16)
                    mask[..., context:] = float("-inf")
                    return softcapped_attention(q, k, v, mask, head_dim ** -0.5, cap)

                alone = attend(-(-context // 16) * 16)
                for length in (1040, 1056, 2096):
                    if length >= context:
                        assert torch.equal(attend(length), alone), (cap, context, length)
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def gemma2(request):
    # 3 query heads per kv head and 64-dim heads, as the default model's shape
    path = tiny_models.tiny_family_path("gemma2", num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                                        intermediate_size=256)
    loaded = load_model(Settings(model_id=str(path), dtype=request.param))
    assert loaded.model.batch_invariant and loaded.model.layout.attn_softcap
    return loaded


def test_a_gemma2_request_computes_the_same_bits_whatever_the_batch(gemma2):
    alone = asyncio.run(run_target(gemma2, TARGET))
    assert asyncio.run(run_target(gemma2, TARGET, OTHERS, position=7, stagger=True)) == alone
    assert asyncio.run(run_target(gemma2, TARGET, warmup=TARGET[:33] + [77])) == alone
    assert asyncio.run(run_target(gemma2, TARGET, OTHERS[:6], position=3, chunked_prefill_tokens=23)) == alone
    assert asyncio.run(run_target(gemma2, TARGET, OTHERS[:6], position=2, speculate=4)) == alone



@pytest.mark.parametrize("shape", [(3, 3, 64, torch.bfloat16), (3, 3, 64, torch.float32), (2, 2, 16, torch.bfloat16),
                                   (2, 4, 64, torch.float32)])
def test_prompt_tokens_get_the_same_soft_capped_bits_in_any_segment(shape):
    """The prompt form with soft-capping (the start-up probe): a token alone, or in segments of any
    size and offset with extra masked keys, gets the same bits."""
    torch_backend._PROBE_CACHE.clear()
    assert torch_backend.prompt_form_invariant(*shape, softcap=2.0)


def test_a_gemma2_model_attends_prompt_tokens_in_the_prompt_form(gemma2):
    assert gemma2.model.model.layers[0].self_attn.backend.prompt_form


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_rows_capped_logits_have_the_bits_it_gets_alone_at_any_place_in_a_large_step(threads):
    """The sigmoid of the capped logits runs in whole vectors (models/layers/elementwise.py): unpadded, the
    scalar tail of a run (the last row's last keys) and the cut between two threads' shares (past
    32768 values) fell inside rows, whose bits then depended on the rows before them."""
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, group, head_dim, length = 3, 3, 64, 304  # 9 * 304 values a row: not whole vectors
    rows = 25  # 68,400 values: past twice torch's grain, cut in 2 or 3 shares
    keys = torch.randn(rows, length, num_kv_heads, head_dim, generator=gen).bfloat16()
    q = (torch.randn(rows, num_kv_heads, group, head_dim, generator=gen) * 3).bfloat16()
    mask = torch.zeros(rows, 1, 1, length, dtype=torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = capped_logits(q, keys.transpose(1, 2), mask, 0.125, 2.0)
        for r in range(rows):
            alone = capped_logits(q[r:r + 1], keys[r:r + 1].transpose(1, 2), mask[r:r + 1], 0.125, 2.0)
            assert torch.equal(together[r:r + 1], alone), r
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("shape", [(3, 3, 64), (4, 2, 256)])
def test_a_soft_capped_rows_bits_do_not_depend_on_the_thread_count(shape):
    """A soft-capped call runs on the step's threads, which the thread governor changes with the
    machine's load (engine/execution/thread_governor.py): a row's bits must not follow them."""
    num_kv_heads, group, head_dim = shape
    gen = torch.Generator().manual_seed(2)
    previous = torch.get_num_threads()
    try:
        for dtype in (torch.bfloat16, torch.float32):
            for rows, n, keys in ((1, group, 96), (16, group, 320), (5, group, 1100), (1, 40, 200)):
                q = (torch.randn(rows, num_kv_heads, n, head_dim, generator=gen) * 3).to(dtype)
                k, v = (torch.randn(2, rows, num_kv_heads, keys, head_dim, generator=gen)).to(dtype)
                mask = torch.zeros(rows, 1, 1, keys, dtype=dtype)
                mask[0, ..., keys // 3:] = float("-inf")
                outs = []
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    outs.append(softcapped_attention(q, k, v, mask, head_dim ** -0.5, 30.0))
                assert all(torch.equal(outs[0], o) for o in outs[1:]), (dtype, rows, n, keys)
    finally:
        torch.set_num_threads(previous)
