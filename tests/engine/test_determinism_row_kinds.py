"""Kernels by row kind (docs/determinism.md): a CPU int4 layer multiplies prompt rows through a
dense copy of its weight and generated rows through the int4 kernel; prompt tokens are attended
in their own batch-invariant form (many query rows a call), generated ones in the decode row's.
A request's tokens and
logprobs stay bitwise those it gets alone: among others (steps mixing prompt and generated rows),
after a prefix-cache hit, with chunked prefill, with --speculate 4, and when its prompt holds an
earlier request's generated text (whose k/v the prefix cache must not serve)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentgi.config import Settings
from opentgi.engine.execution.model_runner import ModelRunner
from opentgi.engine.scheduling.block_manager import BlockManager
from opentgi.models.attention import torch_backend, torch_plan
from opentgi.models.layers.linear import OneDNNLinear
from opentgi.models.layers.row_kinds import GENERATED, MIXED, PROMPT, RowKinds, step_row_kinds
from opentgi.models.loader import load_model
from opentgi.models.quantization.int4 import Int4Groups
from opentgi.models.quantization.linear import QuantizedLinear
from opentgi.models.quantization.prompt_copy import (
    NONDETERMINISTIC_INT4_MAX_ROWS,
    _through_kernel,
    add_prompt_copies,
    dequantize_int4,
)
from tests.helpers import tiny_models
from tests.helpers.cpu_kernels import onednn_param, onednn_serves
from tests.helpers.determinism import OTHERS, TARGET, alone, greedy, outcome, run_target
from tests.helpers.engine import generate, make_seq, running
from tests.helpers.hypothesis_profiles import examples

torch.set_num_threads(1)


def random_int4(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = Int4Groups.from_values(torch.randint(0, 16, (n, k), generator=gen), torch.rand(n, k // 32, generator=gen)
                                    * 0.02, torch.randn(n, k // 32, generator=gen) * 0.01, 32)
    return groups.to_format(dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [128, 96])  # torch's block layout (64 rows a block), and another one
def test_the_dense_copy_holds_the_kernels_own_weights(dtype, n):
    weight = random_int4(n, 256, dtype)
    with torch.inference_mode():
        assert torch.equal(dequantize_int4(weight, dtype), _through_kernel(weight, 256, dtype))


def quantized_with_copy(dtype: torch.dtype, inputs: int = 256) -> QuantizedLinear:
    linear = QuantizedLinear(inputs, 128)
    linear.weight_format = random_int4(128, inputs, dtype, seed=1)
    assert add_prompt_copies(linear, dtype, row_invariant=True) > 0
    assert isinstance(linear.prompt_linear, OneDNNLinear)
    return linear


def test_no_copies_where_they_do_not_all_fit():
    linear = QuantizedLinear(256, 128)
    linear.weight_format = random_int4(128, 256, torch.bfloat16)
    assert add_prompt_copies(linear, torch.bfloat16, row_invariant=True, max_bytes=128 * 256 * 2 - 1) == 0
    assert linear.prompt_linear is None


# the dense copies are oneDNN linears: bfloat16 ones only where this CPU has oneDNN's bfloat16 kernel
_COPY_DTYPES = [torch.float32, onednn_param(torch.bfloat16)]
# inputs of the layers whose two kernels the tests tell apart by their bits: in float32, torch's AVX2
# int4 kernel and oneDNN's give up to 1024 inputs the same bits (not over 2048)
_KERNELS_DIFFER_AT = {torch.float32: 2048, torch.bfloat16: 256}


@pytest.mark.parametrize("dtype", _COPY_DTYPES)
def test_a_quantized_layer_picks_its_kernel_by_row_kind_never_by_row_count(dtype):
    inputs = _KERNELS_DIFFER_AT[dtype]
    linear = quantized_with_copy(dtype, inputs)
    x = torch.randn(10, inputs, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        dense, int4 = linear.prompt_linear(x), linear.weight_format.matmul(x)
        assert not torch.equal(dense, int4)  # two kernels: the kind decides which bits a row gets
        assert torch.equal(linear(x), int4)  # no kinds (logits heads, other callers): the int4 kernel
        with step_row_kinds(RowKinds([10], [10], x.device)):
            assert torch.equal(linear(x), dense)
        with step_row_kinds(RowKinds([0, 0], [4, 6], x.device)):
            assert torch.equal(linear(x), int4)
        kinds = RowKinds([3, 0, 1], [3, 4, 3], x.device)  # rows 0-2 and 7 are prompt tokens
        assert kinds.kind == MIXED
        with step_row_kinds(kinds):
            mixed = linear(x)
        prompt = [0, 1, 2, 7]
        for row in range(10):
            assert torch.equal(mixed[row], (dense if row in prompt else int4)[row])
        # and each row alone, in its kind, gets the same bits (row invariance of both kernels)
        for row in range(10):
            with step_row_kinds(RowKinds([int(row in prompt)], [1], x.device)):
                assert torch.equal(linear(x[row:row + 1])[0], mixed[row])


@pytest.mark.parametrize("dtype", _COPY_DTYPES)
def test_nondeterministic_steps_above_four_rows_take_the_dense_copy_for_every_row(dtype):
    inputs = _KERNELS_DIFFER_AT[dtype]
    linear = QuantizedLinear(inputs, 128)
    linear.weight_format = random_int4(128, inputs, dtype, seed=1)
    assert add_prompt_copies(linear, dtype, row_invariant=False) > 0
    assert linear.dense_above_rows == NONDETERMINISTIC_INT4_MAX_ROWS == 4
    x = torch.randn(6, inputs, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        dense, int4 = linear.prompt_linear(x), linear.weight_format.matmul(x)
        assert not torch.equal(dense, int4)
        with step_row_kinds(RowKinds([0] * 6, [1] * 6, x.device)):  # 6 generated rows: dense
            assert torch.equal(linear(x), dense)
        with step_row_kinds(RowKinds([0] * 5, [1] * 5, x.device)):
            assert torch.equal(linear(x[:5]), dense[:5])
        with step_row_kinds(RowKinds([0] * 4, [1] * 4, x.device)):  # 4 generated rows: int4
            assert torch.equal(linear(x[:4]), int4[:4])
        assert torch.equal(linear(x[:1]), int4[:1])  # no kinds, one row
        assert torch.equal(linear(x), dense)  # no kinds, six rows
        with step_row_kinds(RowKinds([1, 0], [1, 2], x.device)):  # a small mixed step: by kind
            assert torch.equal(linear(x[:3]), torch.cat([dense[:1], int4[1:3]]))
    # the default (batch-invariant) copies never follow the row count
    assert quantized_with_copy(dtype).dense_above_rows is None


def test_a_tokens_kind_is_its_position_also_when_recomputed():
    """Prompt tokens before the prompt's end, generated ones after it: a chunk, a prefix-hit tail,
    a decode row, a verify row, and a sequence recomputed after a preemption (its generated tokens
    fed again with its prompt)."""
    runner = SimpleNamespace(device=torch.device("cpu"))
    seqs = [SimpleNamespace(num_computed_tokens=c, num_prompt_tokens=p) for c, p in
            [(0, 30), (16, 30), (40, 30), (41, 30), (0, 30)]]

    def row_kinds(seqs, num_new_tokens):
        return ModelRunner.row_kinds(runner, ModelRunner._prompt_new_tokens(seqs, num_new_tokens), num_new_tokens)

    kinds = row_kinds(seqs, [10, 14, 1, 5, 35])
    assert kinds.kind == MIXED
    assert kinds.prompt_index.tolist() == list(range(0, 24)) + list(range(30, 60))
    assert kinds.generated_index.tolist() == list(range(24, 30)) + list(range(60, 65))
    assert row_kinds(seqs[:2], [10, 14]).kind == PROMPT
    assert row_kinds(seqs[2:4], [1, 5]).kind == GENERATED
    assert ModelRunner.row_kinds(runner, None, [1] * 5) is None  # a model that does not tell them apart


def test_only_prompt_blocks_enter_the_prefix_cache_when_kernels_follow_the_row_kind():
    for only in (False, True):
        bm = BlockManager(16, 4, prompt_blocks_only=only)
        first = make_seq(list(range(10)))  # 10 prompt tokens, then 8 generated ones
        bm.admit(first)
        assert bm.allocate_slots(first, 18)
        first.token_ids.extend(range(100, 108))
        first.num_computed_tokens = 18
        bm.commit(first)
        assert first.num_hashed_blocks == (2 if only else 4)  # blocks 0-3 and 4-7 hold prompt tokens only
        follow_up = make_seq(first.token_ids + [7, 8])
        assert bm.admit(follow_up) == (8 if only else 16)


@pytest.mark.parametrize("shape", [(2, 3, 16, torch.bfloat16), (2, 3, 16, torch.float32), (3, 3, 64, torch.bfloat16),
                                   (2, 4, 64, torch.bfloat16), (1, 1, 32, torch.bfloat16)])
def test_a_prompt_token_gets_the_same_attention_bits_in_any_segment(shape):
    """The prompt form: a token alone, or in segments of any size and offset with extra masked
    keys, gets the same bits (the probe the model runs at start-up)."""
    torch_backend._PROBE_CACHE.clear()
    assert torch_backend.prompt_form_invariant(*shape)


def test_the_probe_finds_a_form_that_is_not_invariant(monkeypatch):
    """More than 191 query rows a call: sdpa cuts them in blocks of 64, and some rows differ with
    the segment (the probe fails, the backend keeps the decode row's form for prompts)."""
    torch_backend._PROBE_CACHE.clear()
    monkeypatch.setattr(torch_plan, "PROMPT_ROWS", 320)
    try:
        assert not torch_backend.prompt_form_invariant(3, 3, 64, torch.bfloat16)
    finally:
        torch_backend._PROBE_CACHE.clear()


@pytest.fixture(scope="module")
def gguf():
    loaded = load_model(Settings(model_id=str(tiny_models.tiny_gguf_path()), dtype="bfloat16"))
    assert loaded.model.batch_invariant and loaded.model.kernels_by_row_kind
    return loaded


def test_int4_layers_keep_the_contract(gguf):
    reference = alone(gguf, TARGET)
    assert asyncio.run(run_target(gguf, TARGET, OTHERS, position=7, stagger=True)) == reference
    assert asyncio.run(run_target(gguf, TARGET, warmup=TARGET)) == reference
    assert asyncio.run(run_target(gguf, TARGET, warmup=TARGET[:33] + [77])) == reference
    assert asyncio.run(run_target(gguf, TARGET, OTHERS[:6], position=3, chunked_prefill_tokens=23)) == reference
    assert asyncio.run(run_target(gguf, TARGET, OTHERS, position=5, speculate=4)) == reference


def int4_with_copies(loaded) -> list[QuantizedLinear]:
    return [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear) and m.prompt_linear is not None]


# The dense copies are oneDNN linears (models/quantization/prompt_copy.py): a CPU without oneDNN's
# bfloat16 kernel (no avx512bw/vl/dq, no avx_ne_convert) serves bfloat16 int4 layers without them,
# every row through the int4 kernel; the tests of the copies load the model in float32 there.
_COPIES_DTYPE = "bfloat16" if onednn_serves(torch.bfloat16) else "float32"


def test_bfloat16_int4_layers_have_dense_copies_only_with_onednns_kernel(gguf):
    assert bool(int4_with_copies(gguf)) == onednn_serves(torch.bfloat16)


def test_a_nondeterministic_gguf_serves_large_steps_through_the_dense_copies(gguf):
    deterministic = gguf if _COPIES_DTYPE == "bfloat16" else load_model(
        Settings(model_id=str(tiny_models.tiny_gguf_path()), dtype=_COPIES_DTYPE))
    opted_out = load_model(Settings(model_id=str(tiny_models.tiny_gguf_path()), dtype=_COPIES_DTYPE,
                                    nondeterministic=True))
    for loaded, expected in ((deterministic, None), (opted_out, NONDETERMINISTIC_INT4_MAX_ROWS)):
        assert int4_with_copies(loaded) and {m.dense_above_rows for m in int4_with_copies(loaded)} == {expected}


def test_nondeterministic_speculation_still_equals_plain_decoding_alone():
    """--speculate 4: a lone sequence's verify step (5 rows) stays on the int4 kernel, as its
    plain decode rows do, so its tokens and logprobs are plain decoding's."""
    loaded = load_model(Settings(model_id=str(tiny_models.tiny_gguf_path()), dtype=_COPIES_DTYPE,
                                 nondeterministic=True, speculate=4))
    assert {m.dense_above_rows for m in int4_with_copies(loaded)} == {5}
    text = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2, 3"
    prompt = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def decode(speculate):
        async with running(loaded, speculate=speculate) as engine:
            out = await generate(engine, greedy(prompt, 24))
            return outcome(out.sequences[0]), engine.scheduler.accepted_tokens_total

    (plain, _), (speculated, accepted) = asyncio.run(decode(0)), asyncio.run(decode(4))
    assert accepted > 0  # verify steps of several rows really ran
    assert speculated == plain


async def follow_up_after(loaded, first_prompt, new_tokens):
    """(first request's tokens, the follow-up's outcome): the follow-up's prompt is the first
    request's prompt and generated text, and more, sent to the same engine."""
    async with running(loaded) as engine:
        first = await generate(engine, greedy(first_prompt, new_tokens))
        text = list(first_prompt) + list(first.sequences[0].token_ids)  # prompt, generated tokens
        follow = await generate(engine, greedy(text + [198, 4093, 198]))
        assert engine.block_manager.prefix_hit_tokens == 16  # the prompt's one full block, no more
        return text, outcome(follow.sequences[0])


def test_a_prompt_holding_earlier_generated_text_equals_itself_cold(gguf):
    """The first request's generated tokens fill whole blocks computed by the int4 kernel and the
    decode row's attention; the follow-up computes those tokens as prompt tokens cold. Served from
    the prefix cache, they would give the follow-up other numbers."""
    text, got = asyncio.run(follow_up_after(gguf, TARGET[:20], 40))
    assert got == alone(gguf, text + [198, 4093, 198])


@pytest.fixture(scope="module")
def dense():
    loaded = load_model(Settings(model_id=str(tiny_models.tiny_llama_path(intermediate_size=1536,
                                 num_attention_heads=6, num_key_value_heads=2, head_dim=64)), dtype="bfloat16"))
    backend = loaded.model.model.layers[0].self_attn.backend
    assert loaded.model.kernels_by_row_kind and backend.prompt_form
    return loaded


def test_a_dense_model_attends_prompt_tokens_in_their_form_and_keeps_the_contract(dense):
    """No int4 layer: the attention alone follows the row kind, and the prefix cache keeps the
    same rule (the follow-up check here is the contract; the int4 model's test above is the one
    whose bits differ without the rule on these tiny shapes)."""
    reference = alone(dense, TARGET)
    assert asyncio.run(run_target(dense, TARGET, OTHERS, position=7, stagger=True)) == reference
    assert asyncio.run(run_target(dense, TARGET, warmup=TARGET[:33] + [77])) == reference
    assert asyncio.run(run_target(dense, TARGET, OTHERS[:6], position=3, chunked_prefill_tokens=23)) == reference
    assert asyncio.run(run_target(dense, TARGET, OTHERS, position=5, speculate=4)) == reference
    text, got = asyncio.run(follow_up_after(dense, TARGET[:20], 40))
    assert got == alone(dense, text + [198, 4093, 198])


async def run_after_generation(loaded, first, first_new, target_extra, others, position, **engine_settings):
    """The target (the first request's prompt and generated text, then `target_extra`) sent after
    the first request finished, among `others`: (target prompt, its outcome)."""
    async with running(loaded, **engine_settings) as engine:
        done = await generate(engine, greedy(first, first_new))
        target = list(first) + list(done.sequences[0].token_ids) + list(target_extra)
        requests = [greedy(p, n) for p, n in others]
        requests.insert(position, greedy(target))
        handles = [await engine.submit(r) for r in requests]
        results = await asyncio.gather(*(h.result() for h in handles))
    return target, outcome(results[position].sequences[0])


tokens = st.integers(3, 20000)


@settings(max_examples=examples(6))
@given(first=st.lists(tokens, min_size=1, max_size=40), first_new=st.integers(1, 40),
       extra=st.lists(tokens, min_size=1, max_size=20),
       others=st.lists(st.tuples(st.lists(tokens, min_size=1, max_size=30), st.integers(1, 4)), max_size=6),
       position=st.integers(0, 6), chunk=st.sampled_from([512, 5, 23]), speculate=st.sampled_from([0, 4]))
def test_a_prompt_after_any_earlier_generation_equals_itself_cold(gguf, first, first_new, extra, others, position,
                                                                   chunk, speculate):
    """Random earlier generations whose text the target's prompt holds, random batches beside
    the target, chunk sizes and speculation: the target's tokens and logprobs are those it gets
    alone, cold (int4 layers with prompt copies, prompt attention in its own form)."""
    target, got = asyncio.run(run_after_generation(gguf, first, first_new, extra, others, min(position, len(others)),
                                                   chunked_prefill_tokens=chunk, speculate=speculate))
    assert got == alone(gguf, target)
