"""Batch invariance, the default (docs/determinism.md): a greedy request's tokens and logprobs are
bitwise those it gets alone, among 16 others, after a prefix-cache hit, with chunked prefill and
with --speculate 4, in float32 (what a CPU without native bfloat16 serves) and in bfloat16 (what
one with it serves; where oneDNN has no bfloat16 kernel, torch's own, row-tiled).

The tiny model here has an MLP of 1536: its down projection's reduction is longer than 1024, where
oneDNN multiplies a lone row with another kernel than 2 or more rows (models/layers/linear.py);
and 3 query heads per kv head, where float32 attention on 2 threads differed with the batch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentgi.cli import build_parser, inference_mode_line, settings_from
from opentgi.config import Settings
from opentgi.engine.execution.assembly import batch_invariant
from opentgi.kernels import native
from opentgi.models.families import decoder as decoder_family
from opentgi.models.layers import linear as linear_module
from opentgi.models.layers.linear import OneDNNLinear, RowTiledLinear
from opentgi.models.loader import load_model
from opentgi.models.quantization.linear import QuantizedLinear
from tests.helpers import tiny_models
from tests.helpers.cpu_kernels import (
    needs_onednn,
    onednn_serves,
    served_linear_class,
    torch_runs_avx512_kernels,
)
from tests.helpers.determinism import NEW_TOKENS, OTHERS, TARGET, alone, loaded_model, run_target
from tests.helpers.engine import running
from tests.helpers.hypothesis_profiles import examples

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, model_path):
    loaded = loaded_model(model_path, request.param)
    assert loaded.model.batch_invariant
    return loaded


def test_these_run_on_the_default_kv_cache(model):
    """--kv-cache-dtype auto: float16 under a float32 model (every test here runs on it), else the model's."""
    async def cache():
        async with running(model) as engine:
            return engine.info.kv_cache_dtype, {c.dtype for pair in engine.runner.kv_caches for c in pair}

    expected = torch.float16 if model.model.spec.dtype == torch.float32 else torch.bfloat16
    assert asyncio.run(cache()) == (str(expected).removeprefix("torch."), {expected})


def test_among_16_concurrent_others(model):
    reference = alone(model, TARGET)
    assert asyncio.run(run_target(model, TARGET, OTHERS, position=7, stagger=True)) == reference
    assert asyncio.run(run_target(model, TARGET, OTHERS, position=16)) == reference


def test_after_a_prefix_cache_hit(model):
    reference = alone(model, TARGET)
    # the same request twice: the second one's prompt is all cached blocks but its tail
    assert asyncio.run(run_target(model, TARGET, warmup=TARGET)) == reference
    # another prompt with the same first 32 tokens (two blocks)
    assert asyncio.run(run_target(model, TARGET, warmup=TARGET[:33] + [77])) == reference


def test_with_chunked_prefill(model):
    reference = alone(model, TARGET)
    assert asyncio.run(run_target(model, TARGET, chunked_prefill_tokens=5)) == reference
    assert asyncio.run(run_target(model, TARGET, OTHERS[:6], position=3, chunked_prefill_tokens=23)) == reference


def test_with_speculate_4(model):
    reference = alone(model, TARGET)
    assert asyncio.run(run_target(model, TARGET, speculate=4)) == reference
    assert asyncio.run(run_target(model, TARGET, OTHERS, position=5, speculate=4)) == reference


tokens = st.integers(3, 20000)


@settings(max_examples=examples(25))
@given(dtype=st.sampled_from(["float32", "bfloat16"]),
       target=st.lists(tokens, min_size=1, max_size=70),
       others=st.lists(st.tuples(st.lists(tokens, min_size=1, max_size=50), st.integers(1, 6)), max_size=16),
       position=st.integers(0, 16),
       chunk=st.sampled_from([512, 3, 16, 37]),
       prefix=st.none() | st.integers(0, 70),
       speculate=st.sampled_from([0, 4]))
def test_a_request_computes_the_same_bits_whatever_the_batch(model_path, dtype, target, others, position,
                                                             chunk, prefix, speculate):
    """Random batch compositions, prompt lengths, chunk sizes, prefix-cache hits (a warm-up request
    sharing the target's first `prefix` tokens) and speculation: the target's greedy tokens and
    logprobs are bitwise those it gets alone."""
    loaded = loaded_model(model_path, dtype)
    warmup = None if prefix is None else target[:prefix] + [2]
    got = asyncio.run(run_target(loaded, target, others, min(position, len(others)), warmup,
                                 chunked_prefill_tokens=chunk, speculate=speculate))
    assert got == alone(loaded, target)


def _assert_head_on_the_embedding(loaded) -> None:
    """The model's LM head multiplies by its tied embedding's own storage: the native dense rows
    where the kernels are loaded, else row-tiled F.linear."""
    head, embedding = loaded.model.logits_proj, loaded.model.model.embed_tokens.weight
    if native.loaded() is None:
        assert isinstance(head, RowTiledLinear)
        return
    assert type(head) is QuantizedLinear and head.weight_format.qtype in native.DENSE_TYPES
    assert head.weight_format.blocks.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()


def test_bfloat16_without_onednn_through_row_tiled_linears(model_path, monkeypatch):
    """Where oneDNN has no kernel for the dtype, F.linear multiplies at most a measured number of
    rows a call, so that rows stay invariant there too (the LM head: the native dense rows where
    the kernels are loaded)."""
    monkeypatch.setattr(decoder_family, "onednn_linear_usable", lambda device, dtype: False)
    loaded = load_model(Settings(model_id=str(model_path), dtype="bfloat16"))
    assert loaded.model.batch_invariant
    assert isinstance(loaded.model.model.layers[0].feed_forward.down_proj, RowTiledLinear)
    _assert_head_on_the_embedding(loaded)
    reference = asyncio.run(run_target(loaded, TARGET))
    assert asyncio.run(run_target(loaded, TARGET, OTHERS, position=4, stagger=True)) == reference
    assert asyncio.run(run_target(loaded, TARGET, warmup=TARGET, chunked_prefill_tokens=7)) == reference


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tied_head_too_large_for_a_copy_multiplies_by_the_embedding_on_the_native_rows(
        model_path, monkeypatch, dtype):
    """A tied LM head over the packed copy's size limit (a 128k vocabulary's) takes the native dense
    rows on the embedding's own bytes, where the kernels are loaded (else the row-tiled F.linear):
    no copy, and a request's tokens and logprobs stay bitwise those it gets alone."""
    monkeypatch.setattr(decoder_family, "TIED_HEAD_COPY_MAX_BYTES", 0)
    loaded = load_model(Settings(model_id=str(model_path), dtype=dtype))
    _assert_head_on_the_embedding(loaded)
    reference = asyncio.run(run_target(loaded, TARGET))
    assert asyncio.run(run_target(loaded, TARGET, OTHERS, position=4, stagger=True)) == reference
    hidden = torch.randn(5, loaded.model.model.embed_tokens.weight.shape[1]).to(loaded.model.model.embed_tokens.weight)
    with torch.inference_mode():
        want = torch.nn.functional.linear(hidden.double(), loaded.model.model.embed_tokens.weight.double())
        torch.testing.assert_close(loaded.model.compute_logits(hidden).double(), want, atol=1e-4, rtol=1e-2)


_LINEAR_CASES = [
    pytest.param(torch.float32, OneDNNLinear, marks=needs_onednn(torch.float32)),
    pytest.param(torch.bfloat16, OneDNNLinear, marks=needs_onednn(torch.bfloat16)),
    (torch.float32, RowTiledLinear),  # where oneDNN has no kernel for the dtype (any CPU runs it)
    (torch.bfloat16, RowTiledLinear),
]


@pytest.mark.parametrize(("dtype", "cls"), _LINEAR_CASES)
def test_a_linear_gives_a_row_the_same_bits_for_every_row_count(dtype, cls):
    torch.manual_seed(0)
    weight = (torch.randn(64, 1536) * 0.03).to(dtype)
    x = torch.randn(96, 1536).to(dtype)
    invariant = cls(weight)
    if cls is OneDNNLinear:
        assert invariant.make_row_invariant(weight) is not None
    with torch.inference_mode():
        reference = invariant(x)
        for count in (1, 2, 3, 4, 5, 8, 17, 64):
            for start in range(0, 96 - count + 1, count):
                assert torch.equal(invariant(x[start:start + count]), reference[start:start + count])
        # without the padding, oneDNN's AVX-512 kernels give a lone float32 row of K > 1024 other
        # bits (a test that can fail); its AVX2 kernel gives that row the same bits either way
        if cls is OneDNNLinear and dtype == torch.float32 and torch_runs_avx512_kernels():
            plain = OneDNNLinear(weight)
            plain.min_rows = 1  # the kernel as it is, every row count
            assert not torch.equal(plain(x[:1]), plain(x[:2])[:1])


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_lone_decode_row_is_multiplied_as_four_and_keeps_its_bits(model_path, family, monkeypatch):
    """A single stream decodes one row a step: every oneDNN linear (a mixture's experts and the LM
    head too) multiplies it as four rows, the faster kernel (models/layers/linear.py), and the
    request's tokens and logprobs stay bitwise those it gets among 16 others, in bfloat16."""
    if family == "llama":
        loaded = loaded_model(model_path, "bfloat16")
    else:
        if family not in _MOE:
            _MOE[family] = load_model(Settings(model_id=str(tiny_models.tiny_family_path(family)), dtype="bfloat16"))
        loaded = _MOE[family]
    among_others = asyncio.run(run_target(loaded, TARGET, OTHERS, position=7, stagger=True))
    onednn = onednn_serves(torch.bfloat16)
    # without oneDNN's bfloat16 kernel (this CPU lacks its instructions): row-tiled F.linear
    real, rows = torch.ops.mkldnn._linear_pointwise if onednn else torch.nn.functional.linear, []

    def record(x, *args):
        rows.append(x.shape[0])
        return real(x, *args)

    if onednn:
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", record)
    else:
        monkeypatch.setattr(linear_module, "F", SimpleNamespace(linear=record))
    assert asyncio.run(run_target(loaded, TARGET)) == among_others
    if onednn:
        assert rows.count(4) >= NEW_TOKENS and min(rows) == 4
    else:  # a lone row multiplied as two (where the measured tile is more than one row)
        assert isinstance(loaded.model.model.layers[0].self_attn.o_proj, served_linear_class(torch.bfloat16))
        tiles = {m.tile for m in loaded.model.modules() if isinstance(m, RowTiledLinear)}
        assert rows.count(2) >= NEW_TOKENS and (min(tiles) == 1 or min(rows) == 2)


def test_the_mode_is_the_default_and_nondeterministic_opts_out(model_path):
    assert settings_from(build_parser().parse_args(["serve"]), {}).nondeterministic is False
    opted_out = settings_from(build_parser().parse_args(["serve", "--nondeterministic"]), {})
    assert opted_out.nondeterministic is True
    loaded = loaded_model(model_path, "float32", nondeterministic=True)
    assert not loaded.model.batch_invariant and not batch_invariant(loaded)
    assert not loaded.model.model.layers[0].self_attn.backend.batch_invariant
    assert batch_invariant(loaded_model(model_path, "float32"))

    class Info:
        deterministic = True

    assert inference_mode_line(Info()).startswith("deterministic:")
    Info.deterministic = False
    assert inference_mode_line(Info()).startswith("nondeterministic:")


def test_log_probabilities_of_a_row_do_not_depend_on_the_row_count():
    """On 2 threads torch's logsumexp cut one row's sum differently for 64 rows of 49,152 than for
    one; the sampler's row_log_softmax gives each row the same bits for every row count."""
    from opentgi.engine.sampling.sampler import row_log_softmax, row_logsumexp

    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)) * 3
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone_rows = torch.cat([row_log_softmax(logits[i:i + 1]) for i in range(64)])
        lse_rows = torch.cat([row_logsumexp(logits[i:i + 1]) for i in range(64)])
        for count in (2, 16, 64):
            assert torch.equal(row_log_softmax(logits[:count]), alone_rows[:count])
            assert torch.equal(row_logsumexp(logits[:count]), lse_rows[:count])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_two_threads(model_path, dtype):
    """On more than one thread float32 attention gave a batch entry other bits with the number of
    entries: the torch backend attends on one thread there."""
    loaded = loaded_model(model_path, dtype)
    two = {"num_threads": 2, "fixed_threads": True}
    reference = asyncio.run(run_target(loaded, TARGET, **two))
    assert asyncio.run(run_target(loaded, TARGET, OTHERS, position=9, **two)) == reference
    assert asyncio.run(run_target(loaded, TARGET, warmup=TARGET, chunked_prefill_tokens=9, **two)) == reference


_MOE: dict = {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_routed_row_does_not_depend_on_its_neighbours(dtype):
    """A mixture of experts (Mixtral's block, 3 of 4 experts of 1536 features a token: their down
    projections reduce over more than 1024, where a lone row takes another kernel; three outputs a
    token, whose bfloat16 sum depends on how it is rounded) is batch-invariant too: the target's
    experts see other tokens' rows beside its own, or none (a lone decode row skips the sort and
    scatter), and its tokens and logprobs stay those it gets alone."""
    if dtype not in _MOE:
        path = tiny_models.tiny_family_path("mixtral", intermediate_size=1536, num_experts_per_tok=3)
        _MOE[dtype] = load_model(Settings(model_id=str(path), dtype=dtype))
    moe = _MOE[dtype]
    assert moe.model.batch_invariant and batch_invariant(moe)
    assert moe.model.model.layers[0].self_attn.backend.batch_invariant
    reference = asyncio.run(run_target(moe, TARGET))
    assert asyncio.run(run_target(moe, TARGET, OTHERS, position=7, stagger=True)) == reference
    assert asyncio.run(run_target(moe, TARGET, OTHERS[:6], position=3, chunked_prefill_tokens=23)) == reference
    assert asyncio.run(run_target(moe, TARGET, warmup=TARGET, speculate=4)) == reference
