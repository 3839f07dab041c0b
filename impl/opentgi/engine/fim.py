"""Fill-in-the-middle: the infilling prompt for `/v1/completions` with a `suffix`.

The format is found from the tokenizer's own FIM tokens (StarCoder/SantaCoder, Qwen2.5-Coder and
CodeGemma, DeepSeek-Coder, CodeLlama, Codestral), and the prompt is built as token ids around the
encoded prefix and suffix, so FIM tokens that are plain vocabulary entries (CodeLlama's `▁<PRE>`)
work as well as added special tokens. `Settings.fim_template` (`--fim-template`), a text with
`{prefix}` and `{suffix}` placeholders, overrides detection; it is encoded like a plain prompt.
A model with neither answers NotSupportedError (422).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentgi.engine.errors import NotSupportedError

PREFIX_PLACEHOLDER = "{prefix}"
SUFFIX_PLACEHOLDER = "{suffix}"


@dataclass(frozen=True)
class FimFormat:
    name: str
    prefix_token: str
    suffix_token: str
    middle_token: str | None  # None: generation starts right after the last part (Codestral)
    suffix_first: bool = False  # SPM order: suffix part before prefix part (Codestral)


KNOWN_FORMATS: tuple[FimFormat, ...] = (
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    FimFormat("santacoder", "<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    FimFormat("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    FimFormat("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFormat("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>"),
    FimFormat("codellama-plain", "<PRE>", "<SUF>", "<MID>"),
    FimFormat("codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True),
)


def _token_id(tokenizer, token: str) -> int | None:
    vocab = tokenizer.get_vocab()
    return vocab.get(token)


def detect_fim_format(tokenizer) -> FimFormat | None:
    """The first known FIM format whose tokens are all in the tokenizer's vocabulary."""
    vocab = tokenizer.get_vocab()
    for fmt in KNOWN_FORMATS:
        tokens = [fmt.prefix_token, fmt.suffix_token] + ([fmt.middle_token] if fmt.middle_token else [])
        if all(t in vocab for t in tokens):
            return fmt
    return None


def validate_fim_template(template: str) -> None:
    """A `--fim-template` must hold both placeholders exactly once."""
    for placeholder in (PREFIX_PLACEHOLDER, SUFFIX_PLACEHOLDER):
        if template.count(placeholder) != 1:
            raise ValueError(f"--fim-template must contain {placeholder} exactly once: {template!r}")


def render_fim_template(template: str, prefix: str, suffix: str) -> str:
    """Fill `{prefix}`/`{suffix}` without touching braces elsewhere (code is full of them), and
    without re-substituting placeholders that occur inside the user's own text."""
    validate_fim_template(template)
    out = []
    rest = template
    while rest:
        i_p, i_s = rest.find(PREFIX_PLACEHOLDER), rest.find(SUFFIX_PLACEHOLDER)
        hits = [(i, ph) for i, ph in ((i_p, PREFIX_PLACEHOLDER), (i_s, SUFFIX_PLACEHOLDER)) if i >= 0]
        if not hits:
            out.append(rest)
            break
        i, ph = min(hits)
        out.append(rest[:i])
        out.append(prefix if ph == PREFIX_PLACEHOLDER else suffix)
        rest = rest[i + len(ph):]
    return "".join(out)


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and ids[0] == bos


def build_fim_prompt_ids(tokenizer, prefix: str, suffix: str, fim_template: str | None = None) -> list[int]:
    """Token ids of the infilling prompt (sync: call it in a worker thread)."""
    if fim_template:
        try:
            text = render_fim_template(fim_template, prefix, suffix)
        except ValueError as exc:  # a misconfigured server: say so rather than fail with a 500
            raise NotSupportedError(f"`suffix` cannot be served: {exc}") from exc
        return tokenizer.encode(text, add_special_tokens=True)
    fmt = detect_fim_format(tokenizer)
    if fmt is None:
        raise NotSupportedError(
            "`suffix` (fill-in-the-middle) is not supported by this model: its tokenizer has no "
            "FIM tokens (e.g. <fim_prefix>/<fim_suffix>/<fim_middle>); start the server with "
            "--fim-template to set the format")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    prefix_part = [_token_id(tokenizer, fmt.prefix_token)] + encode(prefix)
    suffix_part = [_token_id(tokenizer, fmt.suffix_token)] + encode(suffix)
    ids = [tokenizer.bos_token_id] if _adds_bos(tokenizer) else []
    ids += suffix_part + prefix_part if fmt.suffix_first else prefix_part + suffix_part
    if fmt.middle_token:
        ids.append(_token_id(tokenizer, fmt.middle_token))
    return ids
