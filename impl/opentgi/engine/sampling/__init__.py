"""Sampling and logits processing: the sampler, per-row parameters as tensors, grammars, watermark, speculation."""
