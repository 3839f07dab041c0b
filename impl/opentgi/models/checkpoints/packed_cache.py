"""A GGUF's 4-bit layers kept in the int4 kernel's layout between starts (CPU).

Decoding Q4 blocks and packing them for `_weight_int4pack_mm_for_cpu` is most of a GGUF's start-up
(seconds for a 1B model). The packed bytes and bfloat16 scales are written once to one safetensors
file under `--cache-dir`, keyed by the GGUF's path, size and modification time, the serving dtype
and torch's version; later starts read them back. The file is written only where it is no larger
than the GGUF itself, and a partial or unreadable one is ignored. It is written a tensor at a time
straight from the tensors' memory (`write_safetensors`; safetensors' `save_file` first copies every
tensor into bytes of its own, raising the first start's peak memory). Each tensor is read straight
into memory of its own (`read_safetensors`): one copy resident, and faster than copying each out
of safetensors' memory map, whose source pages fault in one by one (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from opentgi.models.quantization.int4 import Int4Weight

log = logging.getLogger(__name__)
_VERSION = 1  # bump when the packed layout or what is stored changes


_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (the dtypes above), each read into a CPU tensor of its
    own (a later `del` of one frees it alone)."""
    tensors: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        base = 8 + header_size
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            start, stop = info["data_offsets"]
            data = torch.empty(stop - start, dtype=torch.uint8)
            if stop > start and os.preadv(f.fileno(), [memoryview(data.numpy())], base + start) != stop - start:
                raise ValueError(f"{path} ends inside tensor {name!r}")
            tensors[name] = data.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` (CPU, the dtypes above) as a safetensors file: the header, then each tensor's
    bytes in order, written from its own memory (no copy of the whole file)."""
    names = {dtype: name for name, dtype in _DTYPES.items()}
    header, offset = {}, 0
    for name, tensor in tensors.items():
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data 8-byte aligned, as safetensors writes it
    # readable by its owner only, as the files safetensors wrote here before
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors.values():
            if tensor.nbytes:
                f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))


class PackedCache:
    def __init__(self, gguf_path: Path, cache_root: Path, dtype: torch.dtype):
        gguf_path = gguf_path.resolve()
        stat = gguf_path.stat()
        self.limit = stat.st_size
        key = hashlib.sha256(f"{_VERSION}:{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}:"
                             f"{torch.__version__}".encode()).hexdigest()[:12]
        self.path = cache_root / "packed" / f"{gguf_path.stem}-{key}.safetensors"
        self._reading: Future | None = None  # `prefetch`'s read

    def prefetch(self) -> None:
        """Start reading the file in a thread of its own, for `load` to take: start-up imports
        transformers and reads the GGUF's header meanwhile (Python work, while the read waits on
        the file system without the GIL)."""
        if self._reading is None and self.path.is_file():
            pool = ThreadPoolExecutor(1, thread_name_prefix="opentgi-packed-cache")
            self._reading = pool.submit(read_safetensors, self.path)
            pool.shutdown(wait=False)

    def load(self) -> dict[str, Int4Weight]:
        """name -> Int4Weight, or {} when there is no usable file."""
        reading, self._reading = self._reading, None
        if reading is None and not self.path.is_file():
            return {}
        try:
            tensors = reading.result() if reading is not None else read_safetensors(self.path)
            names = {name.rsplit(".", 1)[0] for name in tensors}
            return {name: Int4Weight.from_packed(tensors[f"{name}.packed"], tensors[f"{name}.scales_and_zeros"],
                                                 int(tensors[f"{name}.group_size"]), torch.device("cpu"))
                    for name in names}
        except Exception:  # noqa: BLE001 - a damaged file: pack again from the GGUF
            log.warning("ignoring unreadable packed cache %s", self.path, exc_info=True)
            return {}

    def save(self, weights: dict[str, Int4Weight]) -> None:
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
            write_safetensors(tmp, tensors)
            os.replace(tmp, self.path)
        except OSError:  # a read-only or full cache: the next start packs again
            log.warning("could not write the packed cache %s", self.path, exc_info=True)
        finally:
            tmp.unlink(missing_ok=True)
