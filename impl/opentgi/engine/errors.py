"""Typed errors, raised where they arise. Each API dialect maps them once to its status and body."""

from __future__ import annotations


class OpenTGIError(Exception):
    """Base of every error a client may see."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ValidationError(OpenTGIError):
    """The request is invalid (TGI: 422, error_type "validation")."""


class InputTooLongError(ValidationError):
    """Prompt tokens (+ max_new_tokens) do not fit the limits."""

    def __init__(self, message: str, *, input_tokens: int, max_new_tokens: int | None, limit: int):
        super().__init__(message)
        self.input_tokens = input_tokens
        self.max_new_tokens = max_new_tokens
        self.limit = limit


class UnknownAdapterError(ValidationError):
    """The request names a LoRA adapter the server did not load (422 in every dialect)."""

    def __init__(self, adapter_id: str, loaded: list[str]):
        listed = ", ".join(repr(a) for a in loaded) if loaded else "none (start the server with --lora-adapters)"
        super().__init__(f"adapter {adapter_id!r} is not loaded; loaded adapters: {listed}")
        self.adapter_id = adapter_id
        self.loaded = list(loaded)


class GrammarError(ValidationError):
    """A grammar (JSON schema / regex) could not be compiled."""


class TemplateError(ValidationError):
    """A chat template failed to render (TGI: 422, error_type "template_error")."""


class NotSupportedError(ValidationError):
    """A feature this model or server does not support (e.g. grammar disabled, no FIM tokens)."""


class ModelKindError(NotSupportedError):
    """The route asks for what the served model does not do (embeddings of a generation model,
    generation from an embedding model); the message names what it serves."""

    def __init__(self, message: str, *, served: str, asked: str):
        super().__init__(message)
        self.served = served  # "generation" | "embedding" | "rerank" | "classification"
        self.asked = asked


class OverloadedError(OpenTGIError):
    """Too many concurrent requests (TGI: 429 "Model is overloaded", error_type "overloaded")."""


class GenerationError(OpenTGIError):
    """The model failed while generating (TGI: 424, error_type "generation")."""


class UnhealthyError(OpenTGIError):
    """The engine loop is dead or stalled (TGI: 503, error_type "healthcheck")."""


class AdapterError(ValidationError):
    """A LoRA adapter cannot be loaded or unloaded at run time (a missing folder, another base
    model, a name already taken or not loaded); the server keeps serving."""


class AdapterInUseError(OpenTGIError):
    """An adapter cannot be unloaded while requests in flight use it (409)."""
