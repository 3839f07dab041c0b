"""Quantized weight formats and the kernels that multiply by them."""
