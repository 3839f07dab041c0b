"""A GGUF file's tokenizer as a plain fast tokenizer, with the special tokens the file declares.

transformers' GGUF import (4.57) reads the vocabulary and merges correctly but gets a byte-level
("gpt2") tokenizer's specials wrong: for SmolLM2 it makes `<|im_start|>` both bos and eos and
prepends it to every encoding, although the file says bos = `<|im_start|>` (1), eos = `<|im_end|>`
(2), pad = `<|im_end|>`, unk = `<|endoftext|>` (0) and `add_bos_token = False`. We rebuild the
tokenizer from the file's own metadata so it encodes exactly like the original Hugging Face one.

The token lists are read by our own header reader (gguf_header.py) and handed to transformers'
GGUF converter, the same code its GGUF import runs, so the backend is the one that import builds;
the import itself reads them through gguf-py, an object per element, 10-15 s for a 49k vocabulary
(it remains the fallback should the converter's inputs change shape). The result is still kept as
a small tokenizer folder in the cache directory, keyed by the file's path, size and modification
time; later starts load that folder.
"""

from __future__ import annotations

from pathlib import Path

from opentgi.models.checkpoints.gguf_header import GGUFHeader

_SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


_CACHE_VERSION = 1  # bump when load_gguf_tokenizer builds something different


def cached_gguf_tokenizer(path: str | Path, cache_root: Path, meta: dict[str, object] | None = None):
    """`load_gguf_tokenizer`, built once and kept under `cache_root/tokenizers/`."""
    import hashlib
    import os
    import shutil
    import uuid

    from transformers import PreTrainedTokenizerFast

    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{_CACHE_VERSION}:{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    final = cache_root / "tokenizers" / f"{path.stem}-{key[:12]}"
    if (final / ".complete").exists():
        return PreTrainedTokenizerFast.from_pretrained(final)
    tokenizer = load_gguf_tokenizer(path, meta)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        tokenizer.save_pretrained(tmp)
        (tmp / ".complete").write_text(str(path))
        try:
            os.rename(tmp, final)
        except OSError:  # another process got there first, or a half-made leftover
            if not (final / ".complete").exists():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    except OSError:  # a read-only cache: serve the tokenizer built now
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _model_type(header: GGUFHeader) -> str:
    """The model type transformers' GGUF import gives the file (load_gguf_checkpoint's renames)."""
    arch = str(header.fields["general.architecture"])
    if "llama" in arch and "mistral" in str(header.fields.get("general.name", "")):
        return "mistral"
    return {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}.get(arch, arch)


def _converted(header: GGUFHeader):
    """transformers' tokenizer for the file, as `AutoTokenizer.from_pretrained(gguf_file=...)` builds
    it (its converter, its tokenizer class, the file's tokenizer metadata renamed by its own table),
    from lists our header reader reads."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    parsed: dict[str, dict] = {"tokenizer": {}, "tokenizer_config": {}}
    for key in [*header.fields, *header.array_lengths]:
        prefix, _, rest = key.partition(".")
        if prefix != "tokenizer":
            continue
        value = header.fields[key] if key in header.fields else header.array(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # as the import reads a one-element array
        for part, renames in GGUF_TOKENIZER_MAPPING.items():
            if renames.get(rest) is not None:
                parsed[part][renames[rest]] = value
    model_type = _model_type(header)
    backend, extra = convert_gguf_tokenizer(model_type, parsed["tokenizer"])
    tokenizer_class = TOKENIZER_MAPPING[type(AutoConfig.for_model(model_type))][1]
    kwargs = {"legacy": True, **parsed["tokenizer_config"], **extra}  # later ones win, as in the import
    return tokenizer_class(tokenizer_object=backend, **kwargs)


def load_gguf_tokenizer(path: str | Path, meta: dict[str, object] | None = None):
    """Load the tokenizer stored in a GGUF file, with the file's bos/eos/pad/unk and bos policy
    (`meta`: the file's scalar metadata when already read)."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    header = GGUFHeader(path)  # the scalar metadata and the token lists, in one pass over a map
    try:
        meta = header.fields if meta is None else meta
        try:
            hf_tok = _converted(header)
        except Exception:  # noqa: BLE001 - a file the converter's inputs do not cover: transformers' own import
            # legacy=True is what transformers does when it is not told (and warns about): said here.
            hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, legacy=True)
    finally:
        header.close()
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
