"""Property tests of the text side of a step: incremental detokenizing with SmolLM2's real tokenizer
and stop strings with hold-back.

- Detokenizer: for random generated token ids (any id, the 256 byte-level pieces alone, UTF-8 bytes
  of multi-byte characters split one byte per token, special tokens, real text's tokens), the
  concatenated increments equal one decode of the whole sequence past the prompt.
- Stop strings: for random texts cut into random pieces (tokens) and random stop sets, the streamed
  output never shows a hidden stop string, the stream adds up to the final text, and that text is a
  reference: the text up to the end of the first piece after which a stop string is present, cut at
  the earliest such stop string (before it when hidden, after the whole piece when shown, as TGI).
- Both together through the OutputProcessor: the events' text deltas add up to the sequence's text.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opentgi.engine.output.detokenizer import IncrementalDetokenizer
from opentgi.engine.output.output_processor import OutputProcessor
from opentgi.engine.output.stop_checker import StopChecker
from opentgi.engine.request import FinishReason, GenerationRequest, SamplingParams, StoppingParams
from opentgi.engine.scheduling.sequence import Sequence
from tests.helpers.hypothesis_profiles import examples

TOKENIZER = None


@pytest.fixture(scope="module", autouse=True)
def _tokenizer(smollm2_tokenizer):
    global TOKENIZER
    TOKENIZER = smollm2_tokenizer


# SmolLM2's byte-level BPE has a single-byte piece (GPT-2's bytes_to_unicode) for the bytes of
# UTF-8 but a few control characters and the lead bytes of planes 4-11 (F1, F2: unassigned);
# bytes that never occur in UTF-8 have none.
UTF8_CONTINUATION_AND_LEAD_BYTES = [b for b in range(0x80, 0xF5) if b not in (0xC0, 0xC1, 0xF1, 0xF2)]


def byte_token(b: int) -> int | None:
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    token_id = TOKENIZER.convert_tokens_to_ids(bytes_to_unicode()[b])
    return None if token_id == TOKENIZER.unk_token_id else token_id


multibyte_chars = st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=("Cs",))
text_pieces = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), multibyte_chars), min_size=1,
                      max_size=6)


@st.composite
def token_chunks(draw) -> list[int]:
    kind = draw(st.sampled_from(["any", "byte", "split_char", "special", "text"]))
    if kind == "any":
        return [draw(st.integers(0, len(TOKENIZER) - 1))]
    if kind == "byte":
        return [t for t in [byte_token(draw(st.integers(0, 255)))] if t is not None]
    if kind == "split_char":  # one character's UTF-8 bytes, one byte-level token each
        pieces = [byte_token(b) for b in draw(multibyte_chars).encode()]
        return [] if None in pieces else pieces
    if kind == "special":
        return [draw(st.sampled_from(TOKENIZER.all_special_ids))]
    return TOKENIZER(draw(text_pieces), add_special_tokens=False)["input_ids"]


generated_ids = st.lists(token_chunks(), min_size=1, max_size=12).map(lambda chunks: sum(chunks, [])).filter(bool)
prompts = st.text(min_size=1, max_size=12).filter(lambda t: t.strip())


def decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@settings(max_examples=examples(200))
@given(prompt=prompts, generated=generated_ids)
def test_increments_add_up_to_one_decode(prompt, generated):
    prompt_ids = TOKENIZER(prompt, add_special_tokens=False)["input_ids"]
    # an ASCII token last: it ends whatever character the random bytes left open, so the whole
    # text is emitted by the end
    generated = [*generated, TOKENIZER.convert_tokens_to_ids(".")]
    detok = IncrementalDetokenizer(TOKENIZER, prompt_ids)
    ids = list(prompt_ids)
    increments = []
    for t in generated:
        ids.append(t)
        increments.append(detok.step(ids))
    prompt_text = decode(prompt_ids)
    full = decode(prompt_ids + generated)
    assert full.startswith(prompt_text)
    assert "".join(increments) == full[len(prompt_text):]


# --- stop strings --------------------------------------------------------------------------------
ALPHABET = "ab€\n "  # few characters, so stop strings occur; one of three UTF-8 bytes
texts = st.text(alphabet=ALPHABET, max_size=30)
stop_sets = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3)


def cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


def reference(pieces: list[str], stops: list[str], shown: bool) -> tuple[str, bool]:
    """(final text, stopped): checked after every piece; the earliest-starting stop string present
    in the text so far ends it."""
    text = ""
    for piece in pieces:
        text += piece
        found = [p for p in (text.find(s) for s in stops) if p >= 0]
        if found:
            return (text if shown else text[:min(found)]), True
    return text, False


def stream(checker: StopChecker, pieces: list[str]) -> tuple[list[str], FinishReason | None]:
    out = []
    for i, piece in enumerate(pieces, start=1):
        text, reason = checker.check_text(piece, i)
        out.append(text)
        if reason is not None:
            return out, reason
    out.append(checker.flush())  # ended for another reason (length, eos): held text is released
    return out, None


@settings(max_examples=examples(400))
@given(text=texts, cuts=st.lists(st.integers(0, 64), max_size=12), stops=stop_sets, shown=st.booleans())
def test_stop_strings_hold_back(text, cuts, stops, shown):
    pieces = cut(text, cuts)
    checker = StopChecker(StoppingParams(max_new_tokens=1000, stop_sequences=stops,
                                         include_stop_str_in_output=shown), [], 1 << 20)
    out, reason = stream(checker, pieces)
    expected, stopped = reference(pieces, stops, shown)
    assert "".join(out) == expected
    assert (reason is FinishReason.STOP_SEQUENCE) == stopped
    if not shown:
        streamed = ""
        for delta in out:
            streamed += delta
            assert not any(s in streamed for s in stops), (streamed, stops)


@settings(max_examples=examples(200))
@given(text=texts, cuts=st.lists(st.integers(0, 64), max_size=12), stops=stop_sets,
       sensitive=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=2))
def test_sensitive_words_never_shown(text, cuts, stops, sensitive):
    """SenseNova: sensitive words and stop strings, neither ever shown."""
    pieces = cut(text, cuts)
    checker = StopChecker(StoppingParams(max_new_tokens=1000, stop_sequences=stops,
                                         include_stop_str_in_output=False, sensitive_words=sensitive),
                          [], 1 << 20)
    out, reason = stream(checker, pieces)
    expected, stopped = reference(pieces, stops + sensitive, False)
    assert "".join(out) == expected
    assert (reason is not None) == stopped
    streamed = ""
    for delta in out:
        streamed += delta
        assert not any(w in streamed for w in sensitive + stops), (streamed, sensitive)


# --- detokenizer + stop checker, as the engine runs them -----------------------------------------
@settings(max_examples=examples(100))
@given(prompt=prompts, generated=generated_ids, stops=stop_sets, shown=st.booleans())
def test_output_processor_stream_equals_final_text(prompt, generated, stops, shown):
    prompt_ids = TOKENIZER(prompt, add_special_tokens=False)["input_ids"]
    stopping = StoppingParams(max_new_tokens=len(generated), stop_sequences=stops,
                              include_stop_str_in_output=shown, ignore_eos=True)
    req = GenerationRequest(prompt_ids, SamplingParams(), stopping)
    seq = Sequence(req, 0, seed=None, detokenizer=IncrementalDetokenizer(TOKENIZER, prompt_ids),
                   stop_checker=StopChecker(stopping, [], 1 << 20), processors=[])
    processor = OutputProcessor(TOKENIZER)
    deltas, token_texts = [], []
    for t in generated:
        seq.token_ids.append(t)  # the scheduler appends the step's tokens (update_from_output)
        event = processor.process(seq, len(seq.token_ids), 0.0, None)
        deltas.append(event.text_delta)
        # the reference sees the text of the tokens that are not special (special ones show nothing)
        token_texts.append("" if event.special else event.token_text)
        if event.finish_reason is not None:
            break
    assert event.finish_reason is not None
    assert "".join(deltas) == seq.text
    if event.finish_reason is FinishReason.STOP_SEQUENCE and any(t in TOKENIZER.all_special_ids for t in
                                                                 seq.generated_token_ids):
        return  # a special token's own text can be a stop string: not in the shown text's reference
    expected, stopped = reference(token_texts, stops, shown)
    assert seq.text == expected
    assert stopped == (event.finish_reason is FinishReason.STOP_SEQUENCE)
    if not shown:
        assert not any(s in seq.text for s in stops)


def test_byte_pieces_are_what_the_strategies_assume():
    """Every byte of a multi-byte character has its own piece, so "split_char" splits any of them."""
    pieces = [byte_token(b) for b in UTF8_CONTINUATION_AND_LEAD_BYTES]
    assert None not in pieces
    assert len(set(pieces)) == len(pieces)
    assert [decode([byte_token(b) for b in "€".encode()])] == ["€"]
