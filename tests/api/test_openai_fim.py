"""Fill-in-the-middle prompt building for /v1/completions `suffix` (opentgi.engine.fim)."""

from __future__ import annotations

import pytest

from opentgi.engine.errors import NotSupportedError
from opentgi.engine.fim import (
    build_fim_prompt_ids,
    detect_fim_format,
    render_fim_template,
    validate_fim_template,
)


@pytest.fixture(scope="module")
def fim_tokenizer(tiny_fim_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_fim_llama)


def test_smollm2_has_no_fim_tokens(smollm2_tokenizer):
    assert detect_fim_format(smollm2_tokenizer) is None
    with pytest.raises(NotSupportedError, match="fill-in-the-middle"):
        build_fim_prompt_ids(smollm2_tokenizer, "def f(", "):")


def test_starcoder_format_detected_and_built(fim_tokenizer):
    fmt = detect_fim_format(fim_tokenizer)
    assert fmt is not None and fmt.name == "starcoder"
    ids = build_fim_prompt_ids(fim_tokenizer, "def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    vocab = fim_tokenizer.get_vocab()
    p, s, m = vocab["<fim_prefix>"], vocab["<fim_suffix>"], vocab["<fim_middle>"]
    assert ids[0] == p and ids[-1] == m and ids.count(s) == 1
    text = fim_tokenizer.decode(ids)
    assert text == "<fim_prefix>def add(a, b):\n    return <fim_suffix>\n\nprint(add(1, 2))<fim_middle>"


def test_fim_template_overrides_detection(smollm2_tokenizer):
    template = "<|im_start|>PRE {prefix} SUF {suffix} MID"
    ids = build_fim_prompt_ids(smollm2_tokenizer, "a{suffix}b", "c", fim_template=template)
    # The user's literal "{suffix}" is not substituted again.
    assert smollm2_tokenizer.decode(ids) == "<|im_start|>PRE a{suffix}b SUF c MID"


def test_render_fim_template_leaves_other_braces():
    assert render_fim_template("{x}{prefix}|{suffix}{}", "P{", "}S") == "{x}P{|}S{}"


def test_bad_fim_template_rejected(smollm2_tokenizer):
    with pytest.raises(ValueError):
        validate_fim_template("<fim_prefix>{prefix}<fim_middle>")
    with pytest.raises(NotSupportedError, match="--fim-template"):
        build_fim_prompt_ids(smollm2_tokenizer, "a", "b", fim_template="{prefix}{prefix}{suffix}")


class _FakeTokenizer:
    """A vocabulary with Codestral's FIM tokens (suffix first, no middle token)."""

    bos_token_id = 1

    def get_vocab(self):
        return {"<s>": 1, "[SUFFIX]": 10, "[PREFIX]": 11, "a": 20, "b": 21}

    def encode(self, text, add_special_tokens=True):
        ids = [20 if ch == "a" else 21 for ch in text]
        return ([1] if add_special_tokens else []) + ids


def test_codestral_suffix_first_with_bos():
    assert build_fim_prompt_ids(_FakeTokenizer(), "aa", "b") == [1, 10, 21, 11, 20, 20]
