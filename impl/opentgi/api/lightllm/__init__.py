"""LightLLM's HTTP API (openapi/lightllm.yaml)."""
