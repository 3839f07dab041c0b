"""Pooling models (models/pooling/): what a folder serves, and their vectors and logits against a
float64 recomputation with transformers (tests/helpers/pooling_reference.py); an input's bits are
the same alone and in any batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from opentgi.engine.pooling.inputs import PoolingTokenizer
from opentgi.models.families.decoder import PagedDecoder
from opentgi.models.pooling.folder import PoolingFolderError, detect
from opentgi.models.pooling.loading import build_pooling_model
from opentgi.models.pooling.model import PoolingModel
from opentgi.models.pooling.paged import PagedPoolingModel
from tests.helpers import tiny_models, tiny_pooling
from tests.helpers.pooling_reference import assert_close, reference_embeddings, reference_logits

TEXTS = ["what is deep learning?", "paris is the capital of france", "the cat sat on the mat", "hello",
         "hello world", "deep learning is a branch of machine learning about neural networks"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _load(path):
    from transformers import AutoTokenizer

    folder = detect(path)
    tokenizer = AutoTokenizer.from_pretrained(folder.body)
    model = build_pooling_model(folder, tokenizer, torch.float32, torch.device("cpu"))
    return model, PoolingTokenizer(tokenizer, model.max_length, model.model.config.vocab_size)


def test_folder_kinds():
    bert = detect(tiny_pooling.tiny_bert_embedding_path())
    assert (bert.kind, bert.pooling, bert.normalize, bert.max_seq_length) == ("embedding", "mean", True, 64)
    qwen3 = detect(tiny_pooling.tiny_qwen3_embedding_path())
    assert (qwen3.kind, qwen3.pooling, qwen3.architecture) == ("embedding", "lasttoken", "Qwen3Model")
    assert detect(tiny_pooling.tiny_bert_classifier_path(1)).kind == "rerank"
    classifier = detect(tiny_pooling.tiny_bert_classifier_path(3))
    assert classifier.kind == "classification"
    assert classifier.id2label == {0: "negative", 1: "neutral", 2: "positive"}
    assert detect(tiny_pooling.tiny_qwen3_reranker_path()).kind == "rerank"
    # generation models and the paged path's one-label reward models are not pooling models
    assert detect(tiny_models.tiny_llama_path()) is None
    assert detect(tiny_models.tiny_reward_path()) is None


@pytest.mark.parametrize("builder, paged", [
    (tiny_pooling.tiny_qwen3_embedding_path, True),
    (lambda: tiny_pooling.tiny_qwen3_embedding_path(family="qwen2", pooling="mean"), True),
    (tiny_pooling.tiny_qwen3_reranker_path, True),
    (lambda: tiny_pooling.tiny_qwen3_reranker_path(num_labels=3), True),
    (tiny_pooling.tiny_bert_embedding_path, False),
], ids=["qwen3-embedding", "qwen2-embedding", "qwen3-reranker", "qwen3-classifier", "bert"])
def test_decoders_run_on_the_paged_decoder_code(builder, paged):
    model, _ = _load(builder())
    if paged:
        assert isinstance(model, PagedPoolingModel) and isinstance(model.model, PagedDecoder)
        assert model.model.batch_invariant  # its linears in their row-invariant forms
    else:
        assert isinstance(model, PoolingModel)


def test_decoder_vectors_match_sentence_transformers_float32():
    """sentence-transformers' own `encode` of the Qwen3 folder, in float32, against the served vectors."""
    from sentence_transformers import SentenceTransformer

    path = tiny_pooling.tiny_qwen3_embedding_path()
    model, inputs = _load(path)
    got = [(v / v.norm()).tolist() for v in model.run([inputs.text(t, truncate=False) for t in TEXTS])]
    assert_close(got, SentenceTransformer(str(path), device="cpu").encode(TEXTS).tolist())


def test_unserved_sentence_transformers_modules_are_refused(tmp_path):
    folder = tmp_path / "dense"
    shutil.copytree(tiny_pooling.tiny_bert_embedding_path(), folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingFolderError, match="Dense"):
        detect(folder)
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules[:3]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**config, "pooling_mode_max_tokens": True}))
    with pytest.raises(PoolingFolderError, match="pooling"):
        detect(folder)


@pytest.mark.parametrize("builder", [
    lambda: tiny_pooling.tiny_bert_embedding_path("mean", True),
    lambda: tiny_pooling.tiny_bert_embedding_path("cls", False),
    lambda: tiny_pooling.tiny_encoder_embedding_path("xlm-roberta"),
    lambda: tiny_pooling.tiny_encoder_embedding_path("modernbert"),
    tiny_pooling.tiny_qwen3_embedding_path,
    lambda: tiny_pooling.tiny_qwen3_embedding_path(family="qwen2", pooling="mean"),
    lambda: tiny_pooling.tiny_qwen3_embedding_path(family="llama"),
], ids=["bert-mean", "bert-cls", "xlm-roberta", "modernbert", "qwen3-lasttoken", "qwen2-mean", "llama-lasttoken"])
def test_embeddings_match_the_reference_and_are_batch_invariant(builder):
    path = builder()
    model, inputs = _load(path)
    items = [inputs.text(t, truncate=False) for t in TEXTS]
    batch = model.run(items)
    normalize = model.folder.normalize
    got = [(v / v.norm() if normalize else v).tolist() for v in batch]
    assert_close(got, reference_embeddings(path, TEXTS))
    for i, item in enumerate(items):  # alone, and in another batch with other inputs of its length
        assert torch.equal(model.run([item])[0], batch[i])
        assert torch.equal(model.run([items[-1], item, item])[1], batch[i])


@pytest.mark.parametrize("builder", [tiny_pooling.tiny_bert_embedding_path, tiny_pooling.tiny_qwen3_embedding_path],
                         ids=["bert", "qwen3"])
def test_padded_buckets_keep_every_input_invariant(builder):
    """Inputs of many lengths (bucket edges, the model's maximum, unpadded) share batches; each
    gets the bits it gets alone."""
    model, inputs = _load(builder())
    words = "deep learning is a branch of machine learning about neural networks and data".split()
    lengths = [1, 14, 15, 16, 17, 31, 32, 33, model.max_length - 1, model.max_length]
    items = []
    for n in lengths:  # token lists of exactly n tokens
        items.append(inputs.ids([1 + (i * 7 + n) % 40 for i in range(n)], truncate=False))
    items += [inputs.text(" ".join(words[:k]), truncate=False) for k in (1, 5, 9)]
    batch = model.run(items)
    for i, item in enumerate(items):
        assert torch.equal(model.run([item])[0], batch[i]), len(item.ids)
    assert torch.equal(model.run(items[::-1])[::-1][3], batch[3])


@pytest.mark.parametrize("builder, pairs", [
    (lambda: tiny_pooling.tiny_bert_classifier_path(1), [("what is deep learning?", t) for t in TEXTS]),
    (lambda: tiny_pooling.tiny_bert_classifier_path(3), [(t,) for t in TEXTS]),
    (tiny_pooling.tiny_qwen3_reranker_path, [("what is deep learning?", t) for t in TEXTS]),
    (lambda: tiny_pooling.tiny_qwen3_reranker_path(num_labels=3), [(t,) for t in TEXTS]),
], ids=["bert-cross-encoder", "bert-classifier", "qwen3-reranker", "qwen3-classifier"])
def test_logits_match_the_reference_and_are_batch_invariant(builder, pairs):
    path = builder()
    model, inputs = _load(path)
    items = [inputs.pair(*p, truncate=False) if len(p) == 2 else inputs.text(p[0], truncate=False) for p in pairs]
    batch = model.run(items)
    assert_close([v.tolist() for v in batch], reference_logits(path, pairs))
    for i, item in enumerate(items):
        assert torch.equal(model.run([item])[0], batch[i])


def test_long_inputs_are_refused_or_truncated_to_the_limit():
    model, inputs = _load(tiny_pooling.tiny_bert_embedding_path())
    long_text = " ".join(["deep learning"] * 60)
    with pytest.raises(Exception, match="must have less than 64 tokens"):
        inputs.text(long_text, truncate=False)
    right, left = inputs.text(long_text, truncate=True), inputs.text(long_text, truncate=True, left=True)
    assert len(right.ids) == len(left.ids) == 64
    assert right.ids[0] == left.ids[0] == 2 and right.ids[-1] == left.ids[-1] == 3  # [CLS] ... [SEP] kept
    assert len(inputs.pair("query " * 40, "text " * 40, truncate=True).ids) == 64
    with pytest.raises(Exception, match="outside the vocabulary"):
        inputs.ids([10**6], truncate=False)
