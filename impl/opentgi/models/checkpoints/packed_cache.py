"""A GGUF's 4-bit layers kept in the int4 kernel's layout between starts (CPU).

Decoding Q4 blocks and packing them for `_weight_int4pack_mm_for_cpu` is most of a GGUF's start-up
(seconds for a 1B model). The packed bytes and bfloat16 scales are written once to one safetensors
file under `--cache-dir`, keyed by the GGUF's path, size and modification time, the serving dtype
and torch's version; later starts read them back. The file is written only where it is no larger
than the GGUF itself, and a partial or unreadable one is ignored.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from pathlib import Path

import torch

from opentgi.models.quantization.int4 import Int4Weight

log = logging.getLogger(__name__)
_VERSION = 1  # bump when the packed layout or what is stored changes


class PackedCache:
    def __init__(self, gguf_path: Path, cache_root: Path, dtype: torch.dtype):
        gguf_path = gguf_path.resolve()
        stat = gguf_path.stat()
        self.limit = stat.st_size
        key = hashlib.sha256(f"{_VERSION}:{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}:"
                             f"{torch.__version__}".encode()).hexdigest()[:12]
        self.path = cache_root / "packed" / f"{gguf_path.stem}-{key}.safetensors"

    def load(self) -> dict[str, Int4Weight]:
        """name -> Int4Weight, or {} when there is no usable file."""
        if not self.path.is_file():
            return {}
        from safetensors.torch import load_file

        try:  # copied out of safetensors' memory map, which is then closed: one copy resident
            tensors = {name: tensor.clone() for name, tensor in load_file(str(self.path)).items()}
            names = {name.rsplit(".", 1)[0] for name in tensors}
            return {name: Int4Weight.from_packed(tensors[f"{name}.packed"], tensors[f"{name}.scales_and_zeros"],
                                                 int(tensors[f"{name}.group_size"]), torch.device("cpu"))
                    for name in names}
        except Exception:  # noqa: BLE001 - a damaged file: pack again from the GGUF
            log.warning("ignoring unreadable packed cache %s", self.path, exc_info=True)
            return {}

    def save(self, weights: dict[str, Int4Weight]) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        for name, weight in weights.items():
            tensors[f"{name}.packed"] = weight.packed
            tensors[f"{name}.scales_and_zeros"] = weight.scales_and_zeros
            tensors[f"{name}.group_size"] = torch.tensor(weight.group_size)
        size = sum(t.nbytes for t in tensors.values())
        if not tensors or size > self.limit:
            return
        tmp = self.path.with_name(f".tmp-{self.path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp))
            os.replace(tmp, self.path)
        except OSError:  # a read-only or full cache: the next start packs again
            log.warning("could not write the packed cache %s", self.path, exc_info=True)
        finally:
            tmp.unlink(missing_ok=True)
