"""The tiny thinking model's test plan: its marker token ids, two tool schemas, and `Writer`, a
test-only processor that writes planned tokens where the model is free (tests/conftest.py's `plan`).

A random model writes neither the thinking nor a tool call on its own: `Writer` plays the model's
choices of *when* to close the thinking or open a call, while what the grammar constrains (every
call's JSON) stays the model's own, through the engine's lazy grammar.
"""

from __future__ import annotations

from opentgi.engine.sampling.grammar_trigger import TriggeredGrammar

THINK, END_THINK, CALL, END_CALL = 49152, 49153, 49154, 49155
EOS = 2
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


class Writer:
    """Test-only RowLogitsProcessor: where the row is unconstrained, writes the next planned token."""

    FREE = ("first", "reasoning", "waiting", "free")

    def __init__(self, gate: TriggeredGrammar | None, plan: list[int]):
        self.gate = gate
        self.plan = list(plan)

    def __call__(self, logits) -> None:
        if not self.plan or (self.gate is not None and (self.gate._forced or self.gate.state not in self.FREE)):
            return
        token = self.plan.pop(0)
        logits.fill_(float("-inf"))
        logits[token] = 0.0

    def accept(self, token_id: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


def ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def install_plan(engine, monkeypatch):
    """`plan.tokens = [...]` makes every sequence of the next requests write those tokens where free."""
    original = engine._make_sequences

    class Plan:
        tokens: list[int] = []

    def make(request, grammar_factory):
        seqs = original(request, grammar_factory)
        for seq in seqs:
            gate = next((p for p in seq.processors if isinstance(p, TriggeredGrammar)), None)
            seq.processors.append(Writer(gate, Plan.tokens))
        return seqs

    monkeypatch.setattr(engine, "_make_sequences", make)
    return Plan
