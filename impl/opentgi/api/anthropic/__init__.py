"""Anthropic's Messages API (openapi/anthropic.yaml)."""
