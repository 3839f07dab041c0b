"""Text Embeddings Inference's routes (openapi/tei.yaml): `/embed`, `/rerank`, `/predict`, answered
in TEI's error shape (`errors.tei_error`)."""
