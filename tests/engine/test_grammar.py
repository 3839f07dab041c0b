"""Grammar-constrained decoding (engine/sampling/grammar.py) with SmolLM2's real tokenizer.

Outputs are produced by driving a processor with random logits (many seeds): the sampled text must
always parse and validate against the schema, or fully match the regex.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from opentgi.engine.errors import GrammarError
from opentgi.engine.request import GrammarSpec
from opentgi.engine.sampling.grammar import GrammarCompiler

torch.set_num_threads(1)

EOS = [2, 0]  # <|im_end|>, <|endoftext|>
PAD = 64  # the model's vocabulary is padded past the tokenizer's 49152 ids
SEEDS = range(8)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["name", "age"],
    },
    "order_nested_arrays_enums": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "customer": {"type": "object", "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                         "required": ["name", "vip"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                               "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
                "required": ["sku", "qty", "price"]}},
        },
        "required": ["id", "status", "customer", "items"],
    },
    "refs": {
        "$defs": {"address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": False}},
        "required": ["home", "work"],
    },
    "recursive": {
        "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                       "maxItems": 2}}, "required": ["value"]}},
        "$ref": "#/$defs/node",
    },
    "anyof_const_null": {
        "type": "object",
        "properties": {"result": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "number"}, {"type": "null"}]},
                       "kind": {"const": "answer"}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["result", "kind"],
    },
    "tgi_docs_example": {
        "properties": {"location": {"type": "string"}, "activity": {"type": "string"},
                       "animals_seen": {"type": "integer", "minimum": 1, "maximum": 5},
                       "animals": {"type": "array", "items": {"type": "string"}}},
        "required": ["location", "activity", "animals_seen", "animals"],
    },
}

REGEXES = {
    "ipv4": r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    "sku": r"[A-Z]{3}-\d{4}",
    "choice": r"(yes|no|maybe)",
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z0-9._%+-]{1,20}@[a-z0-9-]{1,10}\.(com|org|net)",
    "sentence_with_spaces": r"[A-Z][a-z ,]{5,40}\.",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
}


@pytest.fixture(scope="module")
def vocab_size(smollm2_tokenizer) -> int:
    return len(smollm2_tokenizer) + PAD


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer, vocab_size):
    c = GrammarCompiler(smollm2_tokenizer, vocab_size, eos_token_ids=EOS)
    yield c
    c.close()


@pytest.fixture(scope="module")
def closers(smollm2_tokenizer) -> torch.Tensor:
    """Token ids made only of JSON closing characters (and '@', '.' that an email needs before its
    closing quote); the driver favours them more and more so that random walks through unbounded
    strings and arrays end."""
    ids = [i for i in range(len(smollm2_tokenizer))
           if (text := smollm2_tokenizer.decode([i])) and set(text) <= set('"}],@.')]
    return torch.tensor(ids)


def drive(factory, seed: int, vocab_size: int, closers: torch.Tensor | None = None,
          max_steps: int = 600) -> tuple[list[int], bool]:
    """Sample from masked random logits until the processor terminates or an EOS is drawn.
    Returns (token ids, ended_with_eos)."""
    proc = factory()
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for step in range(max_steps):
        logits = torch.randn(vocab_size, generator=g) * 2
        if closers is not None and step > 10:
            logits[closers] += 0.25 * (step - 10)
        proc(logits)
        tok = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g))
        proc.accept(tok)
        if tok in EOS:
            assert proc.is_terminated()
            return out, True
        out.append(tok)
        if proc.is_terminated():
            return out, False
    raise AssertionError(f"no termination after {max_steps} steps: {out[:50]}")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_outputs_always_validate(name, compiler, smollm2_tokenizer, vocab_size, closers):
    schema = SCHEMAS[name]
    factory = compiler.compile_sync(GrammarSpec("json", schema))
    for seed in SEEDS:
        ids, _ = drive(factory, seed, vocab_size, closers)
        text = smollm2_tokenizer.decode(ids)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_outputs_always_fully_match(name, compiler, smollm2_tokenizer, vocab_size):
    pattern = REGEXES[name]
    factory = compiler.compile_sync(GrammarSpec("regex", pattern))
    texts = set()
    for seed in SEEDS:
        ids, _ = drive(factory, seed, vocab_size)
        text = smollm2_tokenizer.decode(ids)
        assert re.fullmatch(pattern, text, re.ASCII), text  # `\d` means [0-9], as in outlines (TGI)
        texts.add(text)
    if name != "choice":
        assert len(texts) > 1  # the mask constrains, it does not force one answer


def test_schema_as_json_text_is_the_same_grammar(compiler):
    schema = SCHEMAS["person"]
    a = compiler.compile_sync(GrammarSpec("json", schema))
    b = compiler.compile_sync(GrammarSpec("json", json.dumps(schema, indent=2)))
    assert a.args[0] is b.args[0]  # one cache entry: the same compiled grammar


def test_mask_excludes_padding_special_and_out_of_grammar_ids(compiler, smollm2_tokenizer, vocab_size):
    proc = compiler.compile_sync(GrammarSpec("regex", r"[0-9]+"))()
    logits = torch.zeros(vocab_size)
    proc(logits)
    allowed = torch.nonzero(logits == 0).flatten().tolist()
    assert allowed, "something must be allowed"
    assert all(smollm2_tokenizer.decode([i]).isdigit() for i in allowed)
    assert torch.isinf(logits[len(smollm2_tokenizer):]).all()
    assert torch.isinf(logits[EOS]).all()  # nothing matched yet: the output may not end


def test_wider_logits_row_masks_ids_past_the_vocabulary(compiler, vocab_size):
    proc = compiler.compile_sync(GrammarSpec("regex", r"a"))()
    logits = torch.zeros(vocab_size + 32)
    proc(logits)
    assert torch.isinf(logits[vocab_size:]).all()


def test_complete_output_terminates_and_allows_eos(compiler, smollm2_tokenizer, vocab_size):
    proc = compiler.compile_sync(GrammarSpec("regex", r"yes|no"))()
    for tok in smollm2_tokenizer.encode("yes", add_special_tokens=False):
        assert not proc.is_terminated()
        proc.accept(tok)
    assert proc.is_terminated()  # nothing but EOS may follow
    logits = torch.zeros(vocab_size)
    proc(logits)
    assert torch.nonzero(logits == 0).flatten().tolist() == sorted(EOS)


def test_open_ended_grammar_lets_the_model_choose_to_stop(compiler, smollm2_tokenizer, vocab_size):
    proc = compiler.compile_sync(GrammarSpec("regex", r"\d+"))()
    for tok in smollm2_tokenizer.encode("12", add_special_tokens=False):
        proc.accept(tok)
    assert not proc.is_terminated()
    logits = torch.zeros(vocab_size)
    proc(logits)
    assert (logits[EOS] == 0).all() and (logits[smollm2_tokenizer.convert_tokens_to_ids("3")] == 0)
    proc.accept(EOS[0])
    assert proc.is_terminated()


def test_rejected_token_ends_the_sequence_instead_of_raising(compiler, smollm2_tokenizer, vocab_size):
    proc = compiler.compile_sync(GrammarSpec("regex", r"\d+"))()
    proc.accept(smollm2_tokenizer.convert_tokens_to_ids("a"))
    assert proc.is_terminated()
    logits = torch.zeros(vocab_size)
    proc(logits)
    assert torch.nonzero(logits == 0).flatten().tolist() == sorted(EOS)


@pytest.mark.parametrize("spec, fragment", [
    (GrammarSpec("json", "{not json"), "grammar is not valid: "),
    (GrammarSpec("json", '["a list"]'), "must be an object"),
    (GrammarSpec("json", {"type": 5}), "grammar is not valid: 5 is not valid"),
    (GrammarSpec("json", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "grammar is not valid: "),
    (GrammarSpec("regex", "(unclosed"), "grammar is not valid: "),
    (GrammarSpec("regex", {"a": 1}), "must be a string"),
    (GrammarSpec("ebnf", "root ::= 'a'"), "unknown grammar type 'ebnf'"),
])
async def test_invalid_grammars_raise_grammar_error(compiler, spec, fragment):
    with pytest.raises(GrammarError) as info:
        await compiler.compile(spec)
    assert fragment in info.value.message
    assert info.value.message.startswith("grammar is not valid: ")
    with pytest.raises(GrammarError):  # failures are not cached as successes
        compiler.compile_sync(spec)


async def test_slow_compile_runs_off_the_event_loop(smollm2_tokenizer, vocab_size, monkeypatch):
    compiler = GrammarCompiler(smollm2_tokenizer, vocab_size, eos_token_ids=EOS)
    real, threads = compiler._compile, []

    def slow(key):  # a schema that takes 0.3 s to compile
        threads.append(threading.current_thread())
        time.sleep(0.3)
        return real(key)

    monkeypatch.setattr(compiler, "_compile", slow)
    try:
        task = asyncio.create_task(compiler.compile(GrammarSpec("json", SCHEMAS["person"])))
        ticks = 0
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        assert ticks >= 5  # the loop kept running while the schema compiled
        assert threads and threads[0] is not threading.current_thread()
        assert (await task)().is_terminated() is False
    finally:
        compiler.close()


async def test_compiled_grammars_are_cached_lru(smollm2_tokenizer, vocab_size):
    compiler = GrammarCompiler(smollm2_tokenizer, vocab_size, eos_token_ids=EOS, max_cache=2)
    try:
        spec = GrammarSpec("json", SCHEMAS["order_nested_arrays_enums"])
        first = (await compiler.compile(spec)).args[0]
        assert (await compiler.compile(spec)).args[0] is first
        # LRU of two entries: two other grammars evict the first one.
        await compiler.compile(GrammarSpec("regex", "a"))
        await compiler.compile(GrammarSpec("regex", "b"))
        assert (await compiler.compile(spec)).args[0] is not first
    finally:
        compiler.close()


async def test_cancelled_waiter_does_not_cancel_a_shared_compilation(compiler):
    spec = GrammarSpec("json", SCHEMAS["refs"] | {"title": "cancel-test"})
    waiter = asyncio.create_task(compiler.compile(spec))
    other = asyncio.create_task(compiler.compile(spec))
    await asyncio.sleep(0)
    waiter.cancel()
    factory = await other
    assert factory().is_terminated() is False


def test_processors_from_one_factory_are_independent(compiler, smollm2_tokenizer):
    factory = compiler.compile_sync(GrammarSpec("regex", r"ab|cd"))
    p1, p2 = factory(), factory()
    for tok in smollm2_tokenizer.encode("ab", add_special_tokens=False):
        p1.accept(tok)
    assert p1.is_terminated() and not p2.is_terminated()


@pytest.mark.parametrize("bounds", [{"maxLength": 12}, {"minLength": 2}, {"minLength": 1, "maxLength": 5}])
def test_length_bounded_strings_never_admit_control_characters(bounds, compiler, smollm2_tokenizer,
                                                               vocab_size, closers):
    """xgrammar alone lets raw control characters into a length-bounded string (invalid JSON)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", **bounds}}, "required": ["city"]}
    proc = compiler.compile_sync(GrammarSpec("json", schema))()
    for tok in smollm2_tokenizer.encode('{"city": "Al', add_special_tokens=False):
        proc.accept(tok)
    logits = torch.zeros(vocab_size)
    proc(logits)
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    texts = smollm2_tokenizer.convert_ids_to_tokens(allowed)
    control = [t for t, text in zip(allowed, (smollm2_tokenizer.decode([i]) for i in allowed))
               if any(ord(ch) < 0x20 for ch in text)]
    assert allowed and not control, f"control-character tokens allowed: {control[:10]}"
    assert texts  # letters are still allowed
    factory = compiler.compile_sync(GrammarSpec("json", schema))
    for seed in SEEDS:
        ids, _ = drive(factory, seed, vocab_size, closers)
        jsonschema.validate(json.loads(smollm2_tokenizer.decode(ids)), schema)
