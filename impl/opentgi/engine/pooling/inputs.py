"""Turning a request's texts, token lists and (query, text) pairs into model inputs, with the
model's limit: an input past it is refused (InputTooLongError) unless the request asks to
truncate, which cuts it to the limit as sentence-transformers does (special tokens kept; a pair
cut longest first)."""

from __future__ import annotations

import threading

from opentgi.engine.errors import InputTooLongError, ValidationError
from opentgi.models.pooling.model import PoolingInput


class PoolingTokenizer:
    def __init__(self, tokenizer, max_length: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = vocab_size
        self._lock = threading.Lock()  # `truncation_side` is the tokenizer's state, set per call

    def too_long(self, n: int) -> InputTooLongError:
        return InputTooLongError(f"`inputs` must have less than {self.max_length} tokens. Given: {n}",
                                 input_tokens=n, max_new_tokens=None, limit=self.max_length)

    def text(self, text: str, *, truncate: bool, left: bool = False) -> PoolingInput:
        with self._lock:
            encoding = self.tokenizer(text)
            if len(encoding["input_ids"]) > self.max_length:
                if not truncate:
                    raise self.too_long(len(encoding["input_ids"]))
                self.tokenizer.truncation_side = "left" if left else "right"
                try:
                    encoding = self.tokenizer(text, truncation=True, max_length=self.max_length)
                finally:
                    self.tokenizer.truncation_side = "right"
        return _input(encoding)

    def ids(self, ids: list[int], *, truncate: bool, left: bool = False) -> PoolingInput:
        """Token ids as they are (no special tokens added), as OpenAI's token-list inputs."""
        if not ids:
            raise ValidationError("an input must contain at least one token")
        bad = [i for i in ids if i < 0 or i >= self.vocab_size]
        if bad:
            raise ValidationError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(ids) > self.max_length:
            if not truncate:
                raise self.too_long(len(ids))
            ids = ids[-self.max_length:] if left else ids[:self.max_length]
        return PoolingInput(list(ids))

    def pair(self, first: str, second: str, *, truncate: bool, left: bool = False) -> PoolingInput:
        with self._lock:
            encoding = self.tokenizer(first, second)
            if len(encoding["input_ids"]) > self.max_length:
                if not truncate:
                    raise self.too_long(len(encoding["input_ids"]))
                self.tokenizer.truncation_side = "left" if left else "right"
                try:
                    encoding = self.tokenizer(first, second, truncation="longest_first", max_length=self.max_length)
                finally:
                    self.tokenizer.truncation_side = "right"
        return _input(encoding)


def _input(encoding) -> PoolingInput:
    ids = list(encoding["input_ids"])
    if not ids:
        raise ValidationError("an input must contain at least one token")
    types = encoding.get("token_type_ids")
    return PoolingInput(ids, list(types) if types is not None else None)
