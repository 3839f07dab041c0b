"""Pooling models: embedding models (sentence-transformers folders), cross-encoder rerankers and
sequence classifiers. They run a whole input at once, batched, with no KV cache
(engine/pooling/ drives them): `folder` says what a checkpoint folder is, `model` runs it."""
