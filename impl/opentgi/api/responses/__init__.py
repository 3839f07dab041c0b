"""OpenAI's Responses API (openapi/openai-responses.yaml)."""
