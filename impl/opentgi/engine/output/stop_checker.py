"""When a sequence ends, and which of its text may be shown yet.

Stop strings and sensitive words are matched on the text, at any character position (a match may
span tokens). Text that could still grow into a pattern that must not be shown (a stop string with
`include_stop_str_in_output=False`, or a sensitive word) is held back until it cannot, and released
when the sequence ends for another reason.
"""

from __future__ import annotations

from opentgi.engine.request import FinishReason, StoppingParams


class StopChecker:
    __slots__ = (
        "_hidden",
        "_max_len",
        "_patterns",
        "_tail",
        "eos_token_ids",
        "max_total_tokens",
        "pending",
        "stopping",
    )

    def __init__(self, stopping: StoppingParams, eos_token_ids: list[int] | set[int], max_total_tokens: int,
                 sensitive_words: list[str] = ()):
        self.stopping = stopping
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(stopping.stop_token_ids)
        self.max_total_tokens = max_total_tokens
        # (pattern, reason, shown): shown patterns (TGI stop strings) end up in the output
        self._patterns: list[tuple[str, FinishReason, bool]] = [
            (s, FinishReason.STOP_SEQUENCE, stopping.include_stop_str_in_output)
            for s in stopping.stop_sequences if s]
        self._patterns += [(w, FinishReason.SENSITIVE, False)
                           for w in list(stopping.sensitive_words) + list(sensitive_words) if w]
        self._hidden = [p for p, _, shown in self._patterns if not shown]
        self._max_len = max((len(p) for p, _, _ in self._patterns), default=0)
        self.pending = ""  # text produced but held back
        self._tail = ""  # the last shown characters (a shown stop string may start there)

    def check_text(self, text: str, num_generated: int) -> tuple[str, FinishReason | None]:
        """Feed the new text; returns (text to show now, finish reason if a pattern matched)."""
        if not self._patterns:
            return text, None
        stop_allowed = num_generated >= self.stopping.min_new_tokens
        pending = self.pending + text
        search = self._tail + pending
        best: tuple[int, str, FinishReason, bool] | None = None
        for pattern, reason, shown in self._patterns:
            if reason is FinishReason.STOP_SEQUENCE and not stop_allowed:
                continue
            p = search.find(pattern)
            if p >= 0 and (best is None or p < best[0]):
                best = (p, pattern, reason, shown)
        if best is not None:
            p, _, reason, shown = best
            self.pending = ""
            return (pending if shown else pending[:max(0, p - len(self._tail))]), reason
        hold = self._hold_back(pending)
        shown_text = pending[:len(pending) - hold]
        self.pending = pending[len(pending) - hold:]
        if self._max_len > 1:
            self._tail = (self._tail + shown_text)[-(self._max_len - 1):]
        return shown_text, None

    def check_special(self, token_text: str, num_generated: int) -> FinishReason | None:
        """A special token's text (never part of the shown text) may still be a stop string, e.g.
        "<|im_start|>"."""
        if num_generated < self.stopping.min_new_tokens or not token_text:
            return None
        for pattern, reason, _ in self._patterns:
            if reason is FinishReason.STOP_SEQUENCE and pattern in token_text:
                return reason
        return None

    def _hold_back(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a hidden pattern."""
        best = 0
        for pattern in self._hidden:
            for k in range(min(len(pattern) - 1, len(text)), best, -1):
                if text.endswith(pattern[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """The held-back text, released when the sequence ends for a reason other than a pattern."""
        text, self.pending = self.pending, ""
        return text

    def check_token(self, token_id: int, num_generated: int, num_tokens: int) -> FinishReason | None:
        """Token-level conditions after a token was appended (num_tokens: prompt + generated)."""
        stopping = self.stopping
        if num_generated >= stopping.max_new_tokens:
            return FinishReason.LENGTH
        if token_id in self.eos_token_ids and num_generated >= stopping.min_new_tokens \
                and (not stopping.ignore_eos or token_id in stopping.stop_token_ids):
            return FinishReason.EOS_TOKEN
        if num_tokens >= self.max_total_tokens:
            return FinishReason.CONTEXT
        return None
