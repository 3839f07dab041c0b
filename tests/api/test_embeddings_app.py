"""The pooling routes in process, over the pooling engine and tiny random models: OpenAI's
/v1/embeddings through the `openai` SDK, the Jina/Cohere /v1/rerank, TEI's /embed, /embed_all,
/similarity, /rerank and /predict; their vectors and scores against the float64 reference; each bad input's status and
body in the route's own shape; generation routes on a pooling model and pooling routes on a
generation model refused with a 4xx naming what the model serves."""

from __future__ import annotations

import pytest
import torch

from opentgi.api.app import create_app
from opentgi.config import Settings
from tests.helpers import tiny_pooling
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.pooling_reference import assert_close, reference_embeddings, reference_logits

TEXTS = ["what is deep learning?", "paris is the capital of france", "the cat sat on the mat"]
QUERY = "what is deep learning?"
DOCUMENTS = ["paris is the capital of france", "deep learning is a branch of machine learning",
             "the cat sat on the mat", "neural networks learn from data"]


def _client(path, **settings):
    from opentgi.engine.pooling.engine import PoolingEngine
    from opentgi.models.pooling.folder import detect

    torch.set_num_threads(1)
    settings = Settings(model_id=str(path), device="cpu", num_threads=1, max_client_batch_size=8, **settings)
    engine = PoolingEngine.from_settings(settings, detect(path))
    with create_app(settings, engine).test_client() as client:
        yield client


@pytest.fixture(scope="module")
def embedder():
    yield from _client(tiny_pooling.tiny_bert_embedding_path())


@pytest.fixture(scope="module")
def reranker():
    yield from _client(tiny_pooling.tiny_bert_classifier_path(1))


@pytest.fixture(scope="module")
def classifier():
    yield from _client(tiny_pooling.tiny_bert_classifier_path(3))


@pytest.fixture(scope="module")
def generator():
    settings = Settings(model_id="fake/model")
    with create_app(settings, FakeEngine()).test_client() as client:
        yield client


def test_openai_sdk_embeddings(embedder):
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{embedder.base_url}/v1", api_key="-", http_client=embedder)
    expected = reference_embeddings(tiny_pooling.tiny_bert_embedding_path(), TEXTS)
    answer = sdk.embeddings.create(model="any", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert_close([d.embedding for d in answer.data], expected)
    floats = sdk.embeddings.create(model="any", input=TEXTS[0], encoding_format="float")
    assert_close([floats.data[0].embedding], expected[:1])
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    short = sdk.embeddings.create(model="any", input=TEXTS, dimensions=16, encoding_format="float")
    assert_close([d.embedding for d in short.data],
                 reference_embeddings(tiny_pooling.tiny_bert_embedding_path(), TEXTS, dimensions=16))


def test_openai_embeddings_token_inputs_and_shape(embedder):
    ids = embedder.post("/tokenize", json={"inputs": TEXTS[1]}).json()
    tokens = [t["id"] for t in ids]
    one = embedder.post("/v1/embeddings", json={"model": "m", "input": tokens}).json()
    texts = embedder.post("/v1/embeddings", json={"model": "m", "input": [TEXTS[1]]}).json()
    assert one["object"] == "list" and one["data"][0]["object"] == "embedding"
    assert one["data"][0]["embedding"] == texts["data"][0]["embedding"]  # same tokens, same bits
    assert one["usage"] == {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}
    lists = embedder.post("/v1/embeddings", json={"model": "m", "input": [tokens, tokens[:3]]}).json()
    assert lists["data"][0]["embedding"] == one["data"][0]["embedding"]
    assert len(lists["data"]) == 2


@pytest.mark.parametrize("body, message", [
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ["hello"] * 9}, "batch size 9 > maximum allowed batch size 8"),
    ({"model": "m", "input": " ".join(["deep"] * 80)}, "maximum context length is 64 tokens"),
    ({"model": "m", "input": "hello", "dimensions": 65}, "dimensions"),
    ({"model": "m", "input": [10**6]}, "outside the vocabulary"),
    ({"model": "m", "input": "hello", "encoding_format": "int8"}, "encoding_format"),
])
def test_openai_embeddings_bad_input(embedder, body, message):
    response = embedder.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_tei_embed(embedder):
    path = tiny_pooling.tiny_bert_embedding_path()
    vectors = embedder.post("/embed", json={"inputs": TEXTS}).json()
    assert_close(vectors, reference_embeddings(path, TEXTS))
    raw = embedder.post("/embed", json={"inputs": TEXTS[0], "normalize": False}).json()
    assert abs(sum(v * v for v in raw[0]) - 1) > 1e-3  # mean pooling, not normalized
    long_text = " ".join(["deep"] * 80)
    assert len(embedder.post("/embed", json={"inputs": long_text, "truncate": True}).json()) == 1
    refused = embedder.post("/embed", json={"inputs": long_text})
    assert refused.status_code == 422
    assert refused.json() == {"error": "`inputs` must have less than 64 tokens. Given: 82", "error_type": "Validation"}
    empty = embedder.post("/embed", json={"inputs": []})
    assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"
    many = embedder.post("/embed", json={"inputs": ["a"] * 9})
    assert many.status_code == 422 and many.json()["error"] == "batch size 9 > maximum allowed batch size 8"


def test_tei_embed_all_and_similarity(embedder):
    path = tiny_pooling.tiny_bert_embedding_path()
    reference = reference_embeddings(path, TEXTS)
    tokens = embedder.post("/embed_all", json={"inputs": TEXTS}).json()
    assert [len(rows[0]) for rows in tokens] == [64] * len(TEXTS)
    means = [torch.tensor(rows, dtype=torch.float64).mean(0) for rows in tokens]  # the folder's mean pooling
    assert_close([(m / m.norm()).tolist() for m in means], reference)
    assert len(embedder.post("/embed_all", json={"inputs": TEXTS[0]}).json()) == 1
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS}}
    cosines = embedder.post("/similarity", json=body).json()
    expected = [sum(a * b for a, b in zip(reference[0], other, strict=True)) for other in reference]
    assert max(abs(a - b) for a, b in zip(cosines, expected, strict=True)) <= 1e-4 and abs(cosines[0] - 1) <= 1e-4
    empty = embedder.post("/similarity", json={"inputs": {"source_sentence": "a", "sentences": []}})
    assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"
    many = embedder.post("/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["b"] * 8}})
    assert many.status_code == 422 and many.json()["error"] == "batch size 9 > maximum allowed batch size 8"
    assert embedder.post("/embed_all", json={"inputs": []}).status_code == 400


def test_pooling_model_refuses_other_routes(embedder):
    for path in ("/rerank", "/predict"):
        body = {"query": "q", "texts": ["t"]} if path == "/rerank" else {"inputs": "t"}
        response = embedder.post(path, json=body)
        assert response.status_code == 424 and response.json()["error_type"] == "Backend"
        assert "it serves /v1/embeddings, /embed, /embed_all and /similarity" in response.json()["error"]
    for body in ({"inputs": "hello", "parameters": {"max_new_tokens": 2}}, {"inputs": "hello"}):
        response = embedder.post("/generate", json=body)
        assert response.status_code == 422 and "is an embedding model: it serves" in response.json()["error"]
    response = embedder.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "embedding model" in response.text
    response = embedder.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert 400 <= response.status_code < 500 and "embedding model" in response.text
    response = embedder.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert response.status_code == 400 and "does not serve reranking" in response.json()["error"]["message"]
    info = embedder.get("/info").json()
    assert (info["model_kind"], info["model_pipeline_tag"]) == ("embedding", "feature-extraction")
    assert embedder.get("/v1/models").json()["data"][0]["model_kind"] == "embedding"


def test_generation_model_refuses_pooling_routes(generator):
    response = generator.post("/v1/embeddings", json={"model": "m", "input": "hello"})
    assert response.status_code == 400
    assert "text-generation model: it serves /generate" in response.json()["error"]["message"]
    response = generator.post("/embed", json={"inputs": "hello"})
    assert response.status_code == 424
    assert response.json()["error"].startswith("Model is not an embedding model: ")
    assert generator.post("/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code == 400
    assert generator.post("/rerank", json={"query": "q", "texts": ["d"]}).status_code == 424
    assert generator.post("/embed_all", json={"inputs": "hello"}).status_code == 424
    similarity = generator.post("/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["b"]}})
    assert similarity.status_code == 424 and similarity.json()["error"].startswith("Model is not an embedding model")


def test_rerank_routes(reranker):
    path = tiny_pooling.tiny_bert_classifier_path(1)
    logits = [row[0] for row in reference_logits(path, [(QUERY, d) for d in DOCUMENTS])]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -logits[i])
    ranks = reranker.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True}).json()
    assert [r["index"] for r in ranks] == order
    assert [r["text"] for r in ranks] == [DOCUMENTS[i] for i in order]
    assert_close([[r["score"]] for r in ranks], [[1 / (1 + torch.tensor(logits[i]).neg().exp().item())] for i in order])
    raw = reranker.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}).json()
    assert_close([[r["score"]] for r in raw], [[logits[i]] for i in order])
    assert "text" not in raw[0] or raw[0]["text"] is None
    top = reranker.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert top["results"][0]["document"] == {"text": DOCUMENTS[order[0]]}
    assert top["results"][0]["relevance_score"] == ranks[0]["score"]
    assert top["usage"]["total_tokens"] > 0
    empty = reranker.post("/rerank", json={"query": QUERY, "texts": []})
    assert empty.status_code == 400 and empty.json() == {"error": "`texts` cannot be empty", "error_type": "Empty"}
    assert reranker.post("/v1/rerank", json={"query": QUERY, "documents": []}).status_code == 400
    assert reranker.post("/v1/embeddings", json={"model": "m", "input": "x"}).status_code == 400
    assert reranker.get("/info").json()["model_kind"] == "rerank"


def test_predict(classifier):
    path = tiny_pooling.tiny_bert_classifier_path(3)
    logits = reference_logits(path, [(t,) for t in TEXTS])
    single = classifier.post("/predict", json={"inputs": TEXTS[0]}).json()
    probabilities = torch.tensor(logits[0], dtype=torch.float64).softmax(0).tolist()
    labels = ["negative", "neutral", "positive"]
    expected = sorted(zip(labels, probabilities, strict=True), key=lambda p: -p[1])
    assert [p["label"] for p in single] == [label for label, _ in expected]
    assert_close([[p["score"] for p in single]], [[score for _, score in expected]])
    batch = classifier.post("/predict", json={"inputs": [[t] for t in TEXTS], "raw_scores": True}).json()
    assert len(batch) == 3
    assert_close([sorted(p["score"] for p in row) for row in batch], [sorted(row) for row in logits])
    assert classifier.post("/predict", json={"inputs": []}).status_code == 400
    assert classifier.post("/rerank", json={"query": "q", "texts": ["t"]}).status_code == 424
