"""Pydantic models GENERATED from openapi/ by codegen/ (`nox -s codegen`). Never edit by hand."""
