"""Generates pydantic models from the OpenAPI documents in openapi/ (see generate.py)."""
