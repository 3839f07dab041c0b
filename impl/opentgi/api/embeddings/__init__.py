"""The pooling routes: OpenAI's `/v1/embeddings` and the Jina/Cohere `/v1/rerank`
(openapi/embeddings.yaml, `handlers`), and what they share with TEI's routes (api/tei/): which
engine answers (`common.pooling_engine`), the batch limit, scores."""
