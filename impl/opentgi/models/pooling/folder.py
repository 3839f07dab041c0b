"""What a checkpoint folder serves, read from its files before any weight is loaded.

- **Embedding**: a sentence-transformers folder: `modules.json` lists a Transformer module, a
  Pooling module (its config in the module's folder, e.g. `1_Pooling/config.json`) and optionally a
  Normalize module. Module types are matched by their class name, so the hub's layout
  (`sentence_transformers.models.Pooling`) and later ones (`sentence_transformers.....Pooling`) both
  read. The body is the folder's transformers model: an encoder (BERT, XLM-RoBERTa, ModernBERT; mean
  or CLS pooling) or a decoder (Qwen3, Qwen2, Llama; last-token pooling).
- **Rerank**: a `*ForSequenceClassification` with one label that is not one of the paged path's
  reward models (models/registry.py keeps serving those with /get_score): a cross-encoder.
- **Classification**: a `*ForSequenceClassification` with several labels (`id2label`).

Anything else is a generation model (None).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

POOLING_MODES = ("cls", "mean", "max", "lasttoken")
# sentence-transformers' pooling config flags -> our mode names
_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken"}
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


class PoolingFolderError(ValueError):
    """The folder looks like a pooling model but cannot be served; the message says why."""


@dataclass(frozen=True)
class PoolingFolder:
    kind: str  # "embedding" | "rerank" | "classification"
    architecture: str
    body: Path  # the folder transformers loads the model from
    pooling: str | None = None  # embedding: one of POOLING_MODES
    normalize: bool = False  # embedding: the folder has a Normalize module
    max_seq_length: int | None = None  # sentence-transformers' limit (sentence_bert_config.json)
    id2label: dict[int, str] = field(default_factory=dict)  # rerank / classification


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PoolingFolderError(f"cannot read {path}: {exc}") from None


def _pooling_mode(config: dict, path: Path) -> str:
    if isinstance(config.get("pooling_mode"), str):  # a later layout names the mode
        modes = [config["pooling_mode"].replace("_token", "").replace("last_token", "lasttoken")]
    else:
        modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _POOLING_FLAGS]
    if others or len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise PoolingFolderError(f"{path}: pooling {modes + others or 'none'} is not served; one of "
                                 f"{', '.join(POOLING_MODES)} is")
    return modes[0]


def _embedding_folder(folder: Path, config: dict) -> PoolingFolder:
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        raise PoolingFolderError(f"{folder / 'modules.json'}: not a list of modules")
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules]
    unknown = [name for name, _ in kinds if name not in _KNOWN_MODULES]
    if unknown:
        raise PoolingFolderError(f"{folder}: sentence-transformers modules {unknown} are not served "
                                 f"(served: {', '.join(_KNOWN_MODULES)})")
    paths = {name: path for name, path in kinds}
    if "Transformer" not in paths or "Pooling" not in paths:
        raise PoolingFolderError(f"{folder}: modules.json needs a Transformer and a Pooling module")
    body = folder / paths["Transformer"]
    pooling = _pooling_mode(_read_json(folder / paths["Pooling"] / "config.json"), folder / paths["Pooling"])
    max_seq_length = None
    for name in ("sentence_bert_config.json",):
        if (body / name).is_file():
            max_seq_length = _read_json(body / name).get("max_seq_length")
    architecture = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    return PoolingFolder("embedding", architecture, body, pooling=pooling, normalize="Normalize" in paths,
                         max_seq_length=max_seq_length)


def detect(folder: Path) -> PoolingFolder | None:
    """What `folder` serves as a pooling model; None for a generation model (or a reward model of
    the paged path, or a .gguf file)."""
    folder = Path(folder)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        return None
    config = _read_json(folder / "config.json")
    if (folder / "modules.json").is_file():
        return _embedding_folder(folder, config)
    architecture = (config.get("architectures") or [""])[0]
    if not architecture.endswith("ForSequenceClassification"):
        return None
    from opentgi.models.registry import PAGED_ARCHITECTURES

    id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    num_labels = len(id2label) or int(config.get("num_labels", 2))
    if num_labels == 1 and architecture in PAGED_ARCHITECTURES:
        return None  # a reward model: the paged path serves it (/get_score)
    labels = id2label or {i: f"LABEL_{i}" for i in range(num_labels)}
    return PoolingFolder("rerank" if num_labels == 1 else "classification", architecture, folder, id2label=labels)
