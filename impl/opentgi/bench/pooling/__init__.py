"""Benchmarks of pooling models (docs/embeddings.md): `embeddings`, the server against
sentence-transformers."""
