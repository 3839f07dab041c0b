"""Reading checkpoints: safetensors folders, the default model's GGUF and GGUF tokenizers."""
