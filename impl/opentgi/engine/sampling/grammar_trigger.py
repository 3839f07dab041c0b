"""When a grammar applies: after the model's thinking, and (lazily) only once a trigger was written.

One `TriggeredGrammar` per sequence (a RowLogitsProcessor, engine/sampling/processors.py) follows
the sequence through these states:

- `first`: the model may open its thinking (`ReasoningSpec.start_token_ids`) with its first token;
  what else it may write is what the next state allows;
- `reasoning`: inside the thinking span, nothing is constrained; with a budget, once that many
  thinking tokens were written the end marker is forced, token by token;
- `waiting` (a lazy grammar, `GrammarSpec.trigger_token_ids`): free text until a trigger was
  written (a tool call's opener), then `grammar`; with `force_trigger` the first trigger is forced
  at once (a call is required); with `trigger_at_start`, a first token the grammar accepts starts
  it too (a call written as bare JSON);
- `grammar`: the compiled grammar masks the logits; once it is complete, `end_token_ids` are forced
  (a call's closer), then `waiting` again when `repeat` (another call may follow) or `done`;
- `done`: the sequence ends (the engine finishes it with FinishReason.GRAMMAR);
- `free`: nothing left to constrain (a reasoning budget without a grammar, after the thinking).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opentgi.engine.request import GrammarSpec, ReasoningSpec


def _force(logits: torch.Tensor, token_id: int) -> None:
    logits.fill_(float("-inf"))
    logits[token_id] = 0.0


def _ends_with(ids: list[int], tail: list[int]) -> bool:
    return bool(tail) and len(ids) >= len(tail) and ids[-len(tail):] == tail


class TriggeredGrammar:
    def __init__(self, grammar_factory: Callable | None, spec: GrammarSpec | None,
                 reasoning: ReasoningSpec | None, stop_ids: list[int]):
        self._make = grammar_factory
        self._spec = spec
        self._reasoning = reasoning
        self._stop_ids = stop_ids
        self._grammar = None  # the active GrammarProcessor
        self._forced: list[int] = []  # ids still to force, in order
        self._then: Callable[[], None] | None = None  # what follows the forced ids
        self._recent: list[int] = []  # tokens since the last state change (markers, triggers)
        self._thinking_tokens = 0
        self._wrote = False  # a token was written after the thinking (trigger_at_start no longer applies)
        if reasoning is None:
            self._after_reasoning()
        else:
            self.state = "reasoning" if reasoning.starts_open else "first"

    # --- transitions -----------------------------------------------------------------------------
    def _enter(self, state: str) -> None:
        self.state = state
        self._recent = []

    def _after_reasoning(self, grammar=None) -> None:
        spec = self._spec
        if spec is None or self._make is None:
            self._enter("free")
        elif spec.force_trigger and spec.trigger_token_ids:
            self._enter("forcing")
            self._forced, self._then = list(spec.trigger_token_ids[0]), self._start_grammar
        elif spec.trigger_token_ids:
            self._enter("waiting")
        else:
            self._start_grammar(grammar)

    def _start_grammar(self, grammar=None) -> None:
        self._enter("grammar")
        self._grammar = grammar if grammar is not None else self._make()

    def _after_grammar(self) -> None:
        self._grammar = None
        if self._spec.end_token_ids:
            self._enter("forcing")
            self._forced, self._then = list(self._spec.end_token_ids), self._after_call
        else:
            self._after_call()

    def _after_call(self) -> None:
        self._enter("waiting" if self._spec.repeat else "done")

    # --- RowLogitsProcessor ----------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor) -> None:
        state = self.state
        if self._forced:
            _force(logits, self._forced[0])
        elif state == "reasoning":
            budget = self._reasoning.budget
            if budget is not None and self._thinking_tokens >= budget:
                self._forced, self._then = list(self._reasoning.end_token_ids), self._after_reasoning
                _force(logits, self._forced[0])
        elif state == "first":
            self._first_mask(logits)
        elif state == "grammar":
            self._grammar(logits)
        elif state == "done":
            keep = logits[self._stop_ids].clone()
            logits.fill_(float("-inf"))
            logits[self._stop_ids] = keep

    def _first_mask(self, logits: torch.Tensor) -> None:
        """The first token: the thinking may open, or what follows the thinking starts."""
        spec = self._spec
        if spec is None or self._make is None or (spec.trigger_token_ids and not spec.force_trigger):
            return  # free either way
        opener = self._reasoning.start_token_ids[0]
        keep = logits[opener].clone()
        if spec.force_trigger and spec.trigger_token_ids:
            _force(logits, spec.trigger_token_ids[0][0])
        else:
            if self._grammar is None:
                self._grammar = self._make()
            self._grammar(logits)
        logits[opener] = keep

    def accept(self, token_id: int) -> None:
        if self._forced:
            if token_id == self._forced[0]:
                self._forced.pop(0)
            if not self._forced:
                then, self._then = self._then, None
                if then is not None:
                    then()
            return
        self._recent.append(token_id)
        state = self.state
        if state == "first":
            if _ends_with(self._recent, self._reasoning.start_token_ids):
                self._enter("reasoning")
                return
            self._after_reasoning(self._grammar)  # the grammar that masked this first token, if any
            if self.state != "free":
                self.accept(token_id)
        elif state == "reasoning":
            self._thinking_tokens += 1
            if _ends_with(self._recent, self._reasoning.end_token_ids):
                self._after_reasoning()
        elif state == "waiting":
            if any(_ends_with(self._recent, t) for t in self._spec.trigger_token_ids):
                self._start_grammar()
            elif self._spec.trigger_at_start and not self._wrote:
                grammar = self._make()
                if grammar.try_accept(token_id):
                    self._enter("grammar")
                    self._grammar = grammar
                    if grammar.is_terminated():
                        self._after_grammar()
            self._wrote = True
        elif state == "grammar":
            self._grammar.accept(token_id)
            if self._grammar.is_terminated():
                self._after_grammar()

    def is_terminated(self) -> bool:
        return self.state == "done"
