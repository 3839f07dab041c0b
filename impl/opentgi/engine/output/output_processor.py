"""After the scheduler appended a step's tokens: detokenize each one, decide whether the sequence
ends there and build its TokenEvent."""

from __future__ import annotations

from opentgi.engine.events import TokenEvent, TopToken
from opentgi.engine.request import FinishReason
from opentgi.engine.scheduling.sequence import Sequence


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (for top-n alternatives); memoized."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def process(self, seq: Sequence, end: int, logprob: float | None,
                top: list[tuple[int, float]] | None) -> TokenEvent:
        """The token at seq.token_ids[end - 1] (tokens after it, if any, were accepted in the same
        step and come next). `logprob` is None when the request does not need it."""
        all_ids = seq.token_ids if end == len(seq.token_ids) else seq.token_ids[:end]
        token_id = all_ids[-1]
        if logprob is not None:
            seq.cumulative_logprob += logprob
        num_generated = end - seq.num_prompt_tokens
        special = token_id in self.special_ids
        token_text = seq.detokenizer.step(all_ids)
        stop = seq.stop_checker
        if special:
            shown, reason = "", stop.check_special(token_text, num_generated)
            if reason is not None:
                shown = stop.flush()
        else:
            shown, reason = stop.check_text(token_text, num_generated)
        if reason is None:
            reason = stop.check_token(token_id, num_generated, end)
            if reason is None and seq.processors and any(p.is_terminated() for p in seq.processors):
                reason = FinishReason.EOS_TOKEN if token_id in stop.eos_token_ids else FinishReason.GRAMMAR
            if reason is not None:
                shown += stop.flush()
        seq.text += shown
        if reason is not None:
            seq.finish_reason = reason
        top_tokens = None
        if top is not None:
            top_tokens = [TopToken(id=t, text=self.token_text(t), logprob=lp, special=t in self.special_ids)
                          for t, lp in top]
        return TokenEvent(index=seq.index, token_id=token_id, token_text=token_text, logprob=logprob,
                          special=special, text_delta=shown, generated_tokens=num_generated,
                          top_tokens=top_tokens, finish_reason=reason)
