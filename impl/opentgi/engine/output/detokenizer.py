"""Incremental detokenization (TGI's prefix/read offsets).

Decoding token by token breaks words whose leading space depends on context and characters whose
UTF-8 bytes span several tokens. So each new token is decoded together with a few tokens before it
(`ids[prefix_offset:]`) and the text of those few alone (`ids[prefix_offset:read_offset]`) is cut
off; while the result ends in U+FFFD (an incomplete character) nothing is emitted and the bytes wait
for the next token.
"""

from __future__ import annotations

import functools

INITIAL_CONTEXT_TOKENS = 5


@functools.cache
def _plain_fast(kind: type) -> bool:
    """`kind` decodes as transformers' fast tokenizer does (its `decode` and `_decode` unchanged):
    with clean-up off, its text is its Rust tokenizer's `decode` of the same ids."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (issubclass(kind, PreTrainedTokenizerFast) and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is PreTrainedTokenizerFast._decode)


class IncrementalDetokenizer:
    __slots__ = ("_backend", "_prefix_text", "prefix_offset", "read_offset", "tokenizer")

    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        # the Rust tokenizer itself where the Python layers around it change nothing (a step
        # decodes twice; those layers cost more than the decoding)
        self._backend = tokenizer.backend_tokenizer if _plain_fast(type(tokenizer)) else None
        n = len(prompt_token_ids)
        self.prefix_offset = max(n - INITIAL_CONTEXT_TOKENS, 0)
        self.read_offset = n
        self._prefix_text: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def step(self, all_ids: list[int]) -> str:
        """all_ids: prompt + generated, the new token last. Returns the text it completes ("" while
        a character is still incomplete)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(all_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(all_ids[self.prefix_offset:])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(self._prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(all_ids)
            self._prefix_text = None
            return delta
        return ""
