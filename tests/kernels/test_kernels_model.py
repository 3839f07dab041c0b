"""A GGUF served on the native kernels (`--kernels native`): its projections and its tied head
multiply the file's own blocks, its embedding looks rows up in them, the model computes what the
torch path computes up to the activations' 8-bit rounding, a sequence's logits are the same
bits alone or in a batch, and greedy rows without logprobs get the stack's argmax."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gguf import GGMLQuantizationType

from opentgi.config import Settings
from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from opentgi.kernels import native
from opentgi.models.loader import load_model
from opentgi.models.quantization.gguf_blocks import GGUFBlockWeight, GGUFEmbedding
from opentgi.models.quantization.linear import QuantizedLinear
from tests.helpers import tiny_models
from tests.helpers.engine import generate, running
from tests.helpers.paged import PagedRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_gguf():
    return tiny_models.tiny_gguf_path()


@pytest.fixture(scope="module")
def native_model(kernels, tiny_gguf, tmp_path_factory):
    return load_model(Settings(model_id=str(tiny_gguf), dtype="float32", kernels="native",
                               cache_dir=str(tmp_path_factory.mktemp("cache"))))


@pytest.fixture(scope="module")
def torch_model(tiny_gguf, tmp_path_factory):
    return load_model(Settings(model_id=str(tiny_gguf), dtype="float32", kernels="torch",
                               cache_dir=str(tmp_path_factory.mktemp("cache"))))


def _assert_head_is_the_embeddings_blocks(head: QuantizedLinear, embedding: GGUFEmbedding) -> None:
    """A tied head multiplies the embedding's own blocks: where the AVX-512 variant runs, those bytes
    repacked by sixteen rows (the same bytes, moved: gguf_blocks.py repack_by_16_rows), else the
    embedding's blocks themselves (one set of blocks)."""
    fmt = head.weight_format
    if native.loaded().isa == "avx512":
        assert fmt.qtype == native.Q8_0_R16 and "by 16 rows" in fmt.description
        back = native.repack_by_16_rows(fmt.blocks, GGMLQuantizationType.Q8_0, fmt.in_features, back=True)
        assert torch.equal(back, embedding.gguf_blocks)
    else:
        assert embedding.gguf_blocks.data_ptr() == fmt.blocks.data_ptr()


def test_the_projections_and_the_tied_head_multiply_the_files_blocks(native_model):
    assert native_model.kernels == f"native ({native_model.kernels[8:-1]})"
    layer = native_model.model.model.layers[0]
    # q Q4_0, k Q4_1, v Q6_K: three block types, run side by side; gate Q4_K + up Q4_1 likewise
    qkv = [p.weight_format for p in layer.self_attn.qkv_proj.parts]
    assert [type(f) for f in qkv] == [GGUFBlockWeight] * 3
    assert [f.description.split()[0] for f in qkv] == ["Q4_0", "Q4_1", "Q6_K"]
    assert isinstance(layer.self_attn.o_proj.weight_format, GGUFBlockWeight)
    assert layer.mlp.down_proj.weight_format.description.startswith("Q5_K blocks")
    head = native_model.model.logits_proj
    assert isinstance(head, QuantizedLinear) and head.weight_format.description.startswith("Q8_0 blocks")
    assert head.weight_format.blocks.shape == (49152, 256 // 32 * 34)  # the embedding's bytes
    embedding = native_model.model.model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding)
    _assert_head_is_the_embeddings_blocks(head, embedding)
    resident = native_model.model.resident
    assert "Q8_0 blocks (embedding) 13 MiB" in resident and "float32 0 MiB" in resident  # norms only


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_takes_the_layers_and_leaves_the_embedding_and_head_on_the_files_blocks(
        kernels, tiny_gguf, tmp_path, method):
    """`--quantize` requantizes the layer projections only: the embedding and the tied head stay
    the file's Q8_0 blocks (no dense float copy), as without it, and no packed cache is written."""
    loaded = load_model(Settings(model_id=str(tiny_gguf), dtype="float32", kernels="native",
                                 quantize=method, cache_dir=str(tmp_path)))
    layer = loaded.model.model.layers[0]
    assert loaded.kernels.startswith("native (")
    assert layer.self_attn.o_proj.weight_format.description.startswith("Q8_0" if method == "int8" else "Q4_1")
    head = loaded.model.logits_proj
    assert isinstance(head, QuantizedLinear) and head.weight_format.description.startswith("Q8_0 blocks")
    embedding = loaded.model.model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding)
    _assert_head_is_the_embeddings_blocks(head, embedding)
    assert "Q8_0 blocks (embedding) 13 MiB" in loaded.model.resident
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "packed" in p.name]
    tok, model = loaded.tokenizer, loaded.model  # the blocks' head keeps a row's bits batch-free
    prompts = [tok(text)["input_ids"] for text in ("Once upon a time", "The quick brown fox", "A b c")]
    alone = model.compute_logits(PagedRunner(model).step({0: prompts[0]}))
    batch = model.compute_logits(PagedRunner(model).step(dict(enumerate(prompts))))
    assert torch.equal(alone[0], batch[0])


def test_the_embedding_looks_up_the_values_a_dense_copy_holds(native_model, torch_model):
    ids = torch.tensor([[0, 5, 49151], [17, 17, 3]])
    dense = torch_model.model.model.embed_tokens
    assert torch.equal(native_model.model.model.embed_tokens(ids), dense(ids))


def test_the_native_model_computes_what_the_torch_path_does(native_model, torch_model):
    assert torch_model.kernels == "torch (--kernels torch)"
    prompt = native_model.tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    got, want = (m.model.compute_logits(PagedRunner(m.model).step({0: prompt}))[0]
                 for m in (native_model, torch_model))
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99


def test_a_sequence_gets_the_same_logits_alone_or_in_a_batch(native_model):
    tok = native_model.tokenizer
    prompts = [tok(text)["input_ids"] for text in ("Once upon a time", "The quick brown fox", "A b c d e f g")]
    model = native_model.model
    alone = PagedRunner(model)
    together = PagedRunner(model)
    first = model.compute_logits(alone.step({0: prompts[0]}))
    batch = model.compute_logits(together.step({i: p for i, p in enumerate(prompts)}))
    assert torch.equal(first[0], batch[0])
    for token in (7, 11, 13):  # decode steps: one row alone, three rows together
        first = model.compute_logits(alone.step({0: [token]}))
        batch = model.compute_logits(together.step({0: [token], 1: [token + 1], 2: [token + 2]}))
        assert torch.equal(first[0], batch[0])


def test_greedy_rows_without_logprobs_take_the_stacks_argmax_and_the_same_tokens(native_model):
    """A step whose rows want only their greedy tokens gets them from the decode stack's call
    (StepOutput.sample_tokens, no logits); the tokens are those the logits give, alone or in a batch."""
    prompt = native_model.tokenizer("Once upon a time")["input_ids"]

    async def tokens(needs_logprobs: bool) -> tuple[list[int], int]:
        async with running(native_model) as engine:
            execute, argmaxed = engine.runner.execute, []

            def spy(*args, **kwargs):
                out = execute(*args, **kwargs)
                argmaxed.append(out.sample_tokens is not None)
                return out

            engine.runner.execute = spy
            result = await generate(engine, GenerationRequest(
                prompt, SamplingParams(), StoppingParams(max_new_tokens=12, ignore_eos=True),
                needs_logprobs=needs_logprobs))
            return result.sequences[0].token_ids, sum(argmaxed)

    async def among_others() -> list[int]:  # the same request beside two others, submitted together
        others = [native_model.tokenizer(t)["input_ids"] for t in ("The quick brown fox", "A b c d e f g")]
        async with running(native_model) as engine:
            handles = [await engine.submit(GenerationRequest(
                p, SamplingParams(), StoppingParams(max_new_tokens=12, ignore_eos=True), needs_logprobs=False))
                for p in (others[0], prompt, others[1])]
            return (await handles[1].result()).sequences[0].token_ids

    (with_logprobs, none), (without, taken) = asyncio.run(tokens(True)), asyncio.run(tokens(False))
    assert without == with_logprobs and len(without) == 12
    assert none == 0 and taken == 11  # every decode step; the prompt's step goes through the modules
    assert asyncio.run(among_others()) == without
