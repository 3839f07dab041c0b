"""Incremental detokenization (never a broken UTF-8 character) and stop-string / sensitive-word
handling on text (matches across tokens, hold-back of text that could still become one)."""

from __future__ import annotations

import pytest

from opentgi.engine.output.detokenizer import IncrementalDetokenizer
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import FinishReason, StoppingParams

TEXTS = [
    "Hello 👋 world 🌍🚀, 你好世界！ 日本語のテキスト and café naïve — “quotes” ✓",
    "🙂🙃🙂 emoji only 👨‍👩‍👧‍👦 family",
    "  leading spaces and\nnew lines\n\n\tand tabs",
    "中文标点：，。；「」",
]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_splits_characters(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    prompt = tok("Say:", add_special_tokens=False)["input_ids"]
    generated = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, prompt)
    ids = list(prompt)
    pieces = []
    multi_token_chars = 0
    for t in generated:
        ids.append(t)
        piece = detok.step(ids)
        assert "\ufffd" not in piece
        multi_token_chars += piece == ""
        pieces.append(piece)
    assert "".join(pieces) == tok.decode(generated)
    if any(ord(c) > 0x7FF for c in text):
        assert multi_token_chars > 0  # the test does exercise characters split over tokens


def test_detokenizer_keeps_leading_spaces_from_context(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok("The cat", add_special_tokens=False)["input_ids"]
    generated = tok(" sat on the mat", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, prompt)
    ids = list(prompt)
    out = ""
    for t in generated:
        ids.append(t)
        out += detok.step(ids)
    assert out == " sat on the mat"


def feed(checker: StopChecker, pieces: list[str]) -> tuple[list[str], FinishReason | None]:
    shown = []
    for i, piece in enumerate(pieces, start=1):
        text, reason = checker.check_text(piece, i)
        shown.append(text)
        if reason is not None:
            return shown, reason
    return shown, None


def checker(**kw) -> StopChecker:
    return StopChecker(StoppingParams(max_new_tokens=100, **kw), [2], 10_000)


def test_stop_string_across_tokens_included():
    c = checker(stop_sequences=["END"])
    shown, reason = feed(c, ["hello E", "N", "D and more"])
    assert reason is FinishReason.STOP_SEQUENCE
    assert "".join(shown) == "hello END and more"  # TGI keeps the whole last token


def test_stop_string_inside_one_token_excluded():
    c = checker(stop_sequences=["stop"], include_stop_str_in_output=False)
    shown, reason = feed(c, ["abc", "xxstopyy"])
    assert reason is FinishReason.STOP_SEQUENCE
    assert "".join(shown) == "abcxx"


def test_hold_back_only_what_could_become_a_stop_string():
    c = checker(stop_sequences=["<END>"], include_stop_str_in_output=False)
    assert c.check_text("hello <", 1) == ("hello ", None)
    assert c.check_text("E", 2) == ("", None)
    assert c.check_text("X", 3) == ("<EX", None)  # can no longer match: released
    assert c.check_text("<EN", 4) == ("", None)
    assert c.check_text("D>tail", 5) == ("", FinishReason.STOP_SEQUENCE)


def test_held_text_released_when_ending_otherwise():
    c = checker(stop_sequences=["###"], include_stop_str_in_output=False)
    assert c.check_text("answer #", 1) == ("answer ", None)
    assert c.check_text("#", 2) == ("", None)
    assert c.flush() == "##"


def test_earliest_stop_string_wins():
    c = checker(stop_sequences=["world", "lo w"], include_stop_str_in_output=False)
    shown, reason = feed(c, ["hel", "lo world"])
    assert reason is FinishReason.STOP_SEQUENCE
    assert "".join(shown) == "hel"


def test_included_stop_string_spanning_shown_text():
    c = checker(stop_sequences=["abcdef"])
    shown, reason = feed(c, ["xxabc", "de", "f!"])
    assert reason is FinishReason.STOP_SEQUENCE
    assert "".join(shown) == "xxabcdef!"


def test_min_new_tokens_delays_stop_strings():
    c = checker(stop_sequences=["."], min_new_tokens=3)
    shown, reason = feed(c, ["a.", "b.", "c."])
    assert reason is FinishReason.STOP_SEQUENCE
    assert "".join(shown) == "a.b.c."


def test_sensitive_word_never_shown():
    c = StopChecker(StoppingParams(max_new_tokens=100, sensitive_words=["secret"]), [2], 10_000)
    shown, reason = feed(c, ["the sec", "re", "t plan"])
    assert reason is FinishReason.SENSITIVE
    assert "".join(shown) == "the "


def test_token_conditions():
    c = StopChecker(StoppingParams(max_new_tokens=5, min_new_tokens=2, stop_token_ids=[7]), [2], 20)
    assert c.check_token(2, 1, 10) is None  # EOS before min_new_tokens
    assert c.check_token(2, 2, 11) is FinishReason.EOS_TOKEN
    assert c.check_token(7, 3, 12) is FinishReason.EOS_TOKEN
    assert c.check_token(9, 5, 13) is FinishReason.LENGTH
    assert c.check_token(9, 4, 20) is FinishReason.CONTEXT
    ignore = StopChecker(StoppingParams(max_new_tokens=5, ignore_eos=True), [2], 20)
    assert ignore.check_token(2, 1, 10) is None


def test_special_token_text_can_be_a_stop_string():
    c = checker(stop_sequences=["<|im_start|>"], include_stop_str_in_output=False)
    assert c.check_text("hi <", 1) == ("hi ", None)
    assert c.check_special("<|im_start|>", 2) is FinishReason.STOP_SEQUENCE
    assert c.flush() == "<"
    assert checker(stop_sequences=["x"]).check_special("<|im_end|>", 1) is None
