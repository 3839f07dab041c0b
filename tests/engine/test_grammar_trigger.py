"""engine/sampling/grammar_trigger.py: when a grammar applies (after the thinking, at a trigger),
which tokens it forces (a budget's end marker, a required opener, a call's closer) and when the
sequence ends. Driven token by token against a real compiled grammar (SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

from opentgi.engine.request import GrammarSpec, ReasoningSpec
from opentgi.engine.sampling.grammar import GrammarCompiler
from opentgi.engine.sampling.grammar_trigger import TriggeredGrammar

EOS = [2]
THINK, END_THINK, OPEN, CLOSE = 10, 11, 12, 13  # marker ids (any ids of the vocabulary serve)
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), eos_token_ids=EOS)
    yield c
    c.close()


@pytest.fixture(scope="module")
def ids(smollm2_tokenizer):
    return lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)


def allowed(proc, vocab: int) -> set[int]:
    logits = torch.zeros(vocab)
    proc(logits)
    return set(torch.nonzero(~torch.isinf(logits)).flatten().tolist())


def write(proc, tokens) -> None:
    for t in tokens:
        proc.accept(t)


def test_model_may_open_its_thinking_first_then_the_grammar_applies(compiler, ids, smollm2_tokenizer):
    vocab = len(smollm2_tokenizer)
    spec = GrammarSpec("json", SCHEMA)
    proc = TriggeredGrammar(compiler.compile_sync(spec), spec, ReasoningSpec([THINK], [END_THINK]), EOS)
    first = allowed(proc, vocab)
    assert THINK in first and ids('{"')[0] in first and ids("Hello")[0] not in first
    write(proc, [THINK, *ids("Hello there")])
    assert proc.state == "reasoning" and len(allowed(proc, vocab)) == vocab  # thinking is free
    write(proc, [END_THINK])
    assert proc.state == "grammar" and ids("Hello")[0] not in allowed(proc, vocab)
    write(proc, ids('{"ok": true}'))
    assert proc.is_terminated()


def test_first_token_that_is_no_opener_goes_to_the_grammar(compiler, ids):
    spec = GrammarSpec("json", SCHEMA)
    proc = TriggeredGrammar(compiler.compile_sync(spec), spec, ReasoningSpec([THINK], [END_THINK]), EOS)
    write(proc, ids('{"ok": false}'))
    assert proc.is_terminated()


def test_budget_forces_the_end_marker_without_a_grammar(smollm2_tokenizer):
    proc = TriggeredGrammar(None, None, ReasoningSpec([THINK], [END_THINK], starts_open=True, budget=2), EOS)
    vocab = len(smollm2_tokenizer)
    write(proc, [100, 101])
    assert allowed(proc, vocab) == {END_THINK}
    write(proc, [END_THINK])
    assert proc.state == "free" and len(allowed(proc, vocab)) == vocab and not proc.is_terminated()


def test_lazy_grammar_waits_for_the_opener_and_repeats(compiler, ids, smollm2_tokenizer):
    vocab = len(smollm2_tokenizer)
    spec = GrammarSpec("json", SCHEMA, trigger_token_ids=[[OPEN]], end_token_ids=[CLOSE], repeat=True)
    proc = TriggeredGrammar(compiler.compile_sync(spec), spec, None, EOS)
    write(proc, ids("Some free text"))
    assert proc.state == "waiting" and len(allowed(proc, vocab)) == vocab
    write(proc, [OPEN])
    assert ids("Some")[0] not in allowed(proc, vocab)
    write(proc, ids('{"ok": true}'))
    assert allowed(proc, vocab) == {CLOSE}  # the closer is forced
    write(proc, [CLOSE])
    assert proc.state == "waiting" and not proc.is_terminated()  # another call may follow
    write(proc, [OPEN, *ids('{"ok": false}'), CLOSE])
    assert proc.state == "waiting"


def test_single_call_ends_the_sequence_and_required_forces_the_opener(compiler, ids, smollm2_tokenizer):
    vocab = len(smollm2_tokenizer)
    spec = GrammarSpec("json", SCHEMA, trigger_token_ids=[[OPEN]], force_trigger=True, end_token_ids=[CLOSE])
    proc = TriggeredGrammar(compiler.compile_sync(spec), spec, ReasoningSpec([THINK], [END_THINK]), EOS)
    assert allowed(proc, vocab) == {OPEN, THINK}  # the call, or thinking first
    write(proc, [OPEN, *ids('{"ok": true}'), CLOSE])
    assert proc.is_terminated() and allowed(proc, vocab) == set(EOS)


def test_grammar_may_open_the_answer_when_triggered_at_start(compiler, ids, smollm2_tokenizer):
    vocab = len(smollm2_tokenizer)
    spec = GrammarSpec("json", SCHEMA, trigger_token_ids=[[OPEN]], trigger_at_start=True)
    proc = TriggeredGrammar(compiler.compile_sync(spec), spec, None, EOS)
    assert len(allowed(proc, vocab)) == vocab  # free: the model chooses
    write(proc, ids('{"ok": true}'))
    assert proc.is_terminated()
    proc = TriggeredGrammar(compiler.compile_sync(spec), spec, None, EOS)
    write(proc, ids("Text first, then {"))
    assert proc.state == "waiting"  # past the first token only the opener starts the grammar
    write(proc, [OPEN, *ids('{"ok": true}')])
    assert proc.is_terminated()
