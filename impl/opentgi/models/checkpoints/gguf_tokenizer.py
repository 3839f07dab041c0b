"""A GGUF file's tokenizer as a plain fast tokenizer, with the special tokens the file declares.

transformers' GGUF import (4.57) reads the vocabulary and merges correctly but gets a byte-level
("gpt2") tokenizer's specials wrong: for SmolLM2 it makes `<|im_start|>` both bos and eos and
prepends it to every encoding, although the file says bos = `<|im_start|>` (1), eos = `<|im_end|>`
(2), pad = `<|im_end|>`, unk = `<|endoftext|>` (0) and `add_bos_token = False`. We rebuild the
tokenizer from the file's own metadata so it encodes exactly like the original Hugging Face one.
"""

from __future__ import annotations

from pathlib import Path

import gguf

_SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """The file's scalar and string metadata (token lists left out: they are big)."""
    reader = gguf.GGUFReader(str(path))
    meta: dict[str, object] = {}
    for key, fld in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                   "tokenizer.ggml.scores"):
            continue
        try:
            meta[key] = fld.contents()
        except Exception:  # noqa: BLE001, S112 - an exotic field type we do not need
            continue
    return meta


def load_gguf_tokenizer(path: str | Path):
    """Load the tokenizer stored in a GGUF file, with the file's bos/eos/pad/unk and bos policy."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    meta = read_gguf_metadata(path)
    # legacy=True is what transformers does when it is not told (and warns about): said here.
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, legacy=True)
    backend = hf_tok.backend_tokenizer
    id_to_token = {i: t for t, i in hf_tok.get_vocab().items()}
    specials = {name: id_to_token[int(meta[key])] for name, key in _SPECIAL_KEYS.items()
                if key in meta and int(meta[key]) in id_to_token}
    byte_level = meta.get("tokenizer.ggml.model") == "gpt2"
    if byte_level:
        # A plain byte-level decoder (the import adds sentencepiece's "▁" replacement, wrong for a
        # literal "▁" in text).
        from tokenizers import decoders

        backend.decoder = decoders.ByteLevel()
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos and "bos_token" in specials:
        bos = specials["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, hf_tok.convert_tokens_to_ids(bos))])
    elif add_bos is False or (add_bos is None and byte_level):
        backend.post_processor = (processors.ByteLevel(trim_offsets=False) if byte_level
                                  else processors.TemplateProcessing(single="$A", pair="$A $B"))
    context = meta.get(f"{meta.get('general.architecture')}.context_length")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=int(context) if context else int(1e30),
        clean_up_tokenization_spaces=False,
        **specials,
    )
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        tokenizer.chat_template = template
    return tokenizer
