"""Grammar-constrained decoding: TGI's `grammar` parameter (a JSON schema or a regular expression).

`GrammarCompiler.compile(spec)` compiles a `GrammarSpec` in a worker thread (never on the event loop
nor the engine loop), caches the result by (type, value) and returns a factory; each call of the
factory gives a fresh per-sequence `GrammarProcessor` (a `RowLogitsProcessor`, engine/sampling/processors.py)
that the sampler applies to its row of logits every step.

Library: xgrammar, chosen over llguidance for coverage (every schema keyword TGI accepts, `uniqueItems`
included; `\\d` as [0-9], as outlines reads it) and for where it pays: at compile time, in a worker
thread with the GIL released, keeping the per-token mask cheap. A slow mask delays every sequence of
the batch; a slow compile only its own request. The comparison's method and figures: docs/benchmarks.md.

Semantics (documented differences from TGI 2.1.2 live in docs/differences-from-tgi.md):
- JSON: the value is a schema object or a JSON string holding one; it must be a valid JSON Schema
  (checked with jsonschema's Draft 2020-12 meta-schema, like TGI's router). Output is compact JSON
  with `", "` / `": "` separators (TGI/outlines allow one optional space at those places), the
  properties in schema order, no properties beyond those listed.
- regex: the whole output must match (Python `re.fullmatch` semantics).
- Once the grammar accepts nothing but an end-of-sequence token, `is_terminated()` is True and the
  engine finishes the sequence (FinishReason.GRAMMAR); while the output is complete but may still
  go on (e.g. `\\d+`), the mask allows EOS next to the continuations and the model decides.
- Errors raise `GrammarError` with TGI's message shape: "grammar is not valid: <detail>".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import torch
import xgrammar as xgr

from opentgi.engine.errors import GrammarError
from opentgi.engine.request import GrammarSpec
from opentgi.engine.sampling.grammar_bounds import (
    COMPILE_TIMEOUT_S,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    NORMALISED_CACHE_SIZE,
    check_bounds,
    check_document,
)

logger = logging.getLogger(__name__)

GRAMMAR_TYPES = ("json", "regex")



def _invalid(detail: str) -> GrammarError:
    return GrammarError(f"grammar is not valid: {detail}")


def parse_json_schema(value: Any) -> Any:
    """The schema of a `json` grammar: an object (or boolean schema) given as such or as JSON text."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _invalid(str(e)) from None
    if not isinstance(value, (dict, bool)):
        raise _invalid(f"a JSON schema must be an object, not {type(value).__name__}")
    import jsonschema  # imported lazily: only grammar requests pay for it

    try:
        jsonschema.Draft202012Validator.check_schema(value)
    except jsonschema.SchemaError as e:
        raise _invalid(e.message) from None
    return value


def grammar_key(spec: GrammarSpec) -> tuple[str, str]:
    """Normalised cache key; validates the type and, for JSON, that the value is a valid schema."""
    kind = spec.type
    if kind not in GRAMMAR_TYPES:
        raise _invalid(f"unknown grammar type {kind!r} (expected 'json' or 'regex')")
    if kind == "json":
        value = spec.value
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        if isinstance(value, (dict, bool)):
            value = json.dumps(value)
        elif not isinstance(value, str):
            raise _invalid(f"a JSON schema must be an object, not {type(value).__name__}")
        return kind, _normalised_schema(value)
    check_bounds(spec)
    if not isinstance(spec.value, str):
        raise _invalid(f"a regex grammar must be a string, not {type(spec.value).__name__}")
    return kind, spec.value


_normalised: OrderedDict[bytes, str] = OrderedDict()
_normalised_lock = threading.Lock()


def _normalised_schema(text: str) -> str:
    """Schema text checked against the meta-schema, re-serialised compactly; key order is kept (it
    is the order properties are generated in). Cached by the text's SHA-256, NORMALISED_CACHE_SIZE
    entries at most (the texts are bounded by MAX_SCHEMA_CHARS)."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    with _normalised_lock:
        found = _normalised.get(digest)
        if found is not None:
            _normalised.move_to_end(digest)
            return found
    if len(text) > MAX_SCHEMA_CHARS:
        raise _invalid(f"the JSON schema has {len(text)} characters; at most {MAX_SCHEMA_CHARS} are allowed")
    schema = parse_json_schema_bounded(text)
    normalised = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    with _normalised_lock:
        _normalised[digest] = normalised
        while len(_normalised) > NORMALISED_CACHE_SIZE:
            _normalised.popitem(last=False)
    return normalised


def parse_json_schema_bounded(text: str) -> Any:
    """`parse_json_schema` with the document bounds checked between parsing and the meta-schema."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise _invalid(str(e)) from None
    except RecursionError:
        raise _invalid(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
    check_document(value)
    return parse_json_schema(value)


class GrammarProcessor:
    """One sequence's grammar state: masks its logits row, follows its tokens (RowLogitsProcessor)."""

    __slots__ = (
        "_bitmask",
        "_device_mask",
        "_failed",
        "_fresh",
        "_matcher",
        "_nonstop_bits",
        "_stop_ids",
        "_vocab_size",
    )

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, nonstop_bits: torch.Tensor,
                 stop_ids: list[int]):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._fresh = False  # does _bitmask hold the mask for the current state?
        self._vocab_size = vocab_size
        self._nonstop_bits = nonstop_bits
        self._stop_ids = stop_ids
        self._failed = False
        self._device_mask: torch.Tensor | None = None

    def _mask(self) -> torch.Tensor:
        if not self._fresh:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._fresh = True
        return self._bitmask

    def __call__(self, logits: torch.Tensor) -> None:
        width = logits.shape[-1]
        if self._failed or self._matcher.is_terminated():
            # Called past the end (the engine ends the sequence): leave it nothing but a stop token.
            keep = logits[self._stop_ids].clone()
            logits.fill_(float("-inf"))
            logits[self._stop_ids] = keep
            return
        n = min(width, self._vocab_size)
        mask = self._mask()
        if logits.device.type != "cpu":
            if self._device_mask is None:
                self._device_mask = torch.empty_like(mask, device=logits.device)
            self._device_mask.copy_(mask, non_blocking=True)
            mask = self._device_mask
        xgr.apply_token_bitmask_inplace(logits.view(1, width), mask, vocab_size=n)
        if width > n:
            logits[n:] = float("-inf")  # ids the grammar's vocabulary does not know

    def accept(self, token_id: int) -> None:
        if self._failed or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            # Only when something outside the mask forced the token (e.g. a min_new_tokens EOS ban
            # left nothing allowed). End the sequence rather than raise in the engine loop.
            logger.warning("grammar rejected token %d; ending the sequence", token_id)
            self._failed = True
        self._fresh = False

    def try_accept(self, token_id: int) -> bool:
        """Follow token_id if the grammar allows it; False (and no change) if it does not."""
        self._fresh = False
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        if self._failed or self._matcher.is_terminated():
            return True
        # Complete when nothing but a stop token may follow.
        return not bool(torch.any(self._mask()[0] & self._nonstop_bits))


class GrammarCompiler:
    """Compiles grammars for one tokenizer in worker threads; an LRU cache keyed by (type, value)."""

    def __init__(self, tokenizer, vocab_size: int, *, max_cache: int = 64,
                 eos_token_ids: Sequence[int] | None = None, max_workers: int = 2, compile_threads: int = 1):
        if eos_token_ids is None:
            eos = tokenizer.eos_token_id
            eos_token_ids = [] if eos is None else [eos]
        stop = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=stop or None)
        self.eos_token_ids = list(self._info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=compile_threads, cache_enabled=False)
        self._nonstop_bits = _nonstop_bits(vocab_size, self._info.stop_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="opentgi-grammar")
        self._max_cache = max_cache
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._waiters: dict[Future, int] = {}  # requests awaiting each compile (event loop only)

    async def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> Callable[[], GrammarProcessor]:
        """A factory of per-sequence processors; raises GrammarError. Awaiting never blocks the loop:
        the bounds are checked first, the schema is parsed and checked in a thread, and a compile
        that takes longer than `timeout_s` (COMPILE_TIMEOUT_S) is a GrammarError. Requests asking for
        the same grammar share its compile; when the last of them leaves (cancelled, timed out) a
        compile still queued is dropped. A compile already running in xgrammar cannot be
        interrupted: the bounds keep it short."""
        check_bounds(spec)
        key = await asyncio.to_thread(grammar_key, spec)
        future = self._submit(key)
        self._waiters[future] = self._waiters.get(future, 0) + 1
        try:
            # shield: a caller that leaves must not cancel a compilation other requests share.
            compiled = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                              COMPILE_TIMEOUT_S if timeout_s is None else timeout_s)
        except TimeoutError:
            raise _invalid(f"the grammar took longer than {COMPILE_TIMEOUT_S if timeout_s is None else timeout_s:g} s "
                           f"to compile") from None
        finally:
            self._leave(key, future)
        return partial(GrammarProcessor, compiled, self.vocab_size, self._nonstop_bits, self.eos_token_ids)

    def _leave(self, key, future: Future) -> None:
        left = self._waiters.get(future, 1) - 1
        if left > 0:
            self._waiters[future] = left
            return
        self._waiters.pop(future, None)
        if not future.done() and future.cancel():  # nobody waits for it and it has not started
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def compile_sync(self, spec: GrammarSpec) -> Callable[[], GrammarProcessor]:
        """Blocking variant for callers outside an event loop (tests, benchmarks)."""
        check_bounds(spec)
        compiled = self._submit(grammar_key(spec)).result()
        return partial(GrammarProcessor, compiled, self.vocab_size, self._nonstop_bits, self.eos_token_ids)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _submit(self, key: tuple[str, str]) -> Future:
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self._max_cache:
                self._cache.popitem(last=False)
        future.add_done_callback(partial(self._forget_failure, key))
        return future

    def _forget_failure(self, key: tuple[str, str], future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        kind, value = key
        try:
            if kind == "json":
                schema = json.dumps(_bounded_strings_as_patterns(json.loads(value)))
                return self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            return self._compiler.compile_regex(value)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors carry a message
            raise _invalid(_xgrammar_message(e)) from None


# One character of a JSON string that needs no escape: not a quote, backslash or control character.
_PLAIN_JSON_STRING_CHAR = r'[^"\\\x00-\x1f]'
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})  # data, not subschemas


def _bounded_strings_as_patterns(node):
    """xgrammar 0.2.8 compiles a string with minLength/maxLength to a raw character class that lets
    control characters through, which no JSON parser accepts inside a string. The same bounds as a
    pattern over plain JSON string characters keep every output parseable (and still valid against
    the original schema: the pattern only narrows which characters are used)."""
    if isinstance(node, list):
        return [_bounded_strings_as_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _NOT_SCHEMAS else _bounded_strings_as_patterns(v)) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not _NOT_SCHEMAS.union({"pattern", "format"}) & out.keys():
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_JSON_STRING_CHAR}{{{low},{'' if high is None else high}}}$"
    return out


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[02:24:18] /project/cpp/x.cc:83: "


def _xgrammar_message(e: Exception) -> str:
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return _XGRAMMAR_LOG_PREFIX.sub("", text)


def _nonstop_bits(vocab_size: int, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """int32 bitmask words with a 1 for every real token id except the stop tokens."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    for t in stop_token_ids:
        if 0 <= t < vocab_size:
            allowed[t] = False
    words = xgr.get_bitmask_shape(1, vocab_size)[1]
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[:vocab_size] = allowed
    bits = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
