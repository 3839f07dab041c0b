"""A GGUF file's metadata and tensor index, read in one pass without loading its token lists.

gguf-py's `GGUFReader` turns every element of every metadata array into a numpy view: for a
49k-token vocabulary with its merges that takes seconds, at every start. Serving needs the scalar
and string metadata, the arrays' lengths and where each tensor lies; this reader walks the header
with `struct` (skipping array elements) and maps the file once (numpy memmap), in milliseconds.
Block sizes and type names come from gguf-py (GGML_QUANT_SIZES, GGMLQuantizationType).

A truncated or corrupt file is refused here, before anything is served, with the tensor named:
an unknown type, a row that is not whole blocks, data off the file's alignment, running past the
end of the file or into the next tensor's data (`_check_extents`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def tensor_nbytes(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    """The bytes a tensor of `dims` (ggml's order) and `qtype` takes; a row that is not a whole
    number of blocks is refused, naming the tensor."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if not dims or dims[0] % block:
        raise ValueError(f"tensor {name!r} ({qtype.name}, shape {list(dims)}): {dims[0] if dims else 0} "
                         f"values a row are not a whole number of {qtype.name} blocks of {block}")
    return int(np.prod(dims, dtype=np.int64)) // block * type_size


def _tensor_type(name: str, type_id: int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {name!r} has GGML type id {type_id}, which is unknown") from None
    if qtype not in GGML_QUANT_SIZES:
        raise ValueError(f"tensor {name!r} has GGML type {qtype.name}, whose block size is unknown")
    return qtype


def _check_extents(infos, alignment: int, data_bytes: int) -> None:
    """Every tensor's data lies inside the file's data section, starts on the file's alignment and
    ends before the next tensor's starts (a size that disagrees with the shape and type shows as
    an overlap, or as a run past the end); the error names the tensor."""
    spans = []
    for name, dims, qtype, offset in infos:
        nbytes = tensor_nbytes(name, dims, qtype)
        what = f"tensor {name!r} ({qtype.name}, shape {list(dims)}, {nbytes} bytes at data offset {offset})"
        if offset % alignment:
            raise ValueError(f"{what}: the offset is not a multiple of the file's alignment {alignment} "
                             "(a corrupt file)")
        if offset + nbytes > data_bytes:
            raise ValueError(f"{what}: its data runs past the end of the file's {data_bytes} data bytes "
                             "(a truncated or corrupt file)")
        spans.append((offset, offset + nbytes, name, what))
    spans.sort()
    for (_, end, _, what), (start, _, following, _) in zip(spans, spans[1:]):
        if end > start:
            raise ValueError(f"{what}: its data overlaps tensor {following!r}'s at data offset {start} "
                             "(its size does not match its shape and type, or the file is corrupt)")


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the contiguous dimension first
    data: np.ndarray  # F32 / F16: [rows, columns] of that dtype; other types: uint8 [rows, bytes per row]


class GGUFHeader:
    """`fields`: scalar and string metadata; `array_lengths`: how many elements each array holds;
    `tensors`: name -> GGUFTensor (views into the memory-mapped file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fields: dict[str, object] = {}
        self.array_lengths: dict[str, int] = {}
        self._arrays: dict[str, tuple[int, int, int]] = {}  # key -> (item type, count, offset of the first)
        self.tensors: dict[str, GGUFTensor] = {}
        with open(self.path, "rb") as handle:
            head = handle.read(24)
            if len(head) < 24 or head[:4] != _MAGIC:
                raise ValueError("not a GGUF file (no GGUF magic)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (big-endian or unknown) is not read")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(buf, pos)
            (value_type,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            if value_type == _ARRAY:
                (item_type, count), pos = struct.unpack_from("<IQ", buf, pos), pos + 12
                self.array_lengths[key] = count
                self._arrays[key] = (item_type, count, pos)
                pos = self._skip_array(buf, pos, item_type, count)
            else:
                self.fields[key], pos = self._value(buf, pos, value_type)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            qtype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), _tensor_type(name, qtype), offset))
        buf.release()
        alignment = int(self.fields.get("general.alignment", 32))
        if alignment <= 0 or alignment % 8:
            raise ValueError(f"general.alignment {alignment} is not a positive multiple of 8")
        data_start = (pos + alignment - 1) // alignment * alignment
        _check_extents(infos, alignment, self._map.shape[0] - data_start)
        for name, dims, qtype, offset in infos:
            self.tensors[name] = GGUFTensor(name, qtype, dims, self._tensor_data(data_start + offset, dims, qtype))

    @staticmethod
    def _string(buf, pos: int, errors: str = "replace") -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", buf, pos)
        start = pos + 8
        return bytes(buf[start:start + length]).decode("utf-8", errors=errors), start + length

    def _value(self, buf, pos: int, value_type: int) -> tuple[object, int]:
        if value_type == _STRING:
            return self._string(buf, pos)
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"GGUF metadata value type {value_type} is unknown")
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)

    @staticmethod
    def _skip_array(buf, pos: int, item_type: int, count: int) -> int:
        if item_type == _STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buf, pos)
                pos += 8 + length
            return pos
        if item_type == _ARRAY:
            raise ValueError("GGUF arrays of arrays are not read")
        return pos + count * struct.calcsize(_SCALARS[item_type])

    def array(self, key: str) -> list:
        """The elements of the metadata array `key` as Python values (str, int, float or bool),
        read straight from the map: a 49k-token vocabulary in tens of milliseconds."""
        item_type, count, pos = self._arrays[key]
        if item_type == _STRING:
            buf, out = memoryview(self._map), []
            try:
                for _ in range(count):
                    text, pos = self._string(buf, pos, errors="strict")
                    out.append(text)
            finally:
                buf.release()
            return out
        fmt = _SCALARS[item_type]
        values = np.frombuffer(self._map, dtype=np.dtype(fmt), count=count, offset=pos).tolist()
        return [bool(v) for v in values] if item_type == 7 else values

    def _tensor_data(self, start: int, dims: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
        """A view of the tensor's data (its extent checked by `_check_extents`)."""
        block, type_size = GGML_QUANT_SIZES[qtype]
        columns = int(dims[0])
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        row_bytes = columns // block * type_size
        raw = self._map[start:start + rows * row_bytes].reshape(rows, row_bytes)
        if qtype == GGMLQuantizationType.F32:
            raw = raw.view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            raw = raw.view(np.float16)
        return raw if len(dims) > 1 else raw[0]

    def close(self, unmap: bool = True) -> None:
        """Drop the map; with `unmap` also close it, which would pull the pages from under any
        view still in use (numpy's views do not keep a closed map readable), so a reader whose
        tensors are served as views of the file passes False: the map then goes with its last view."""
        self.tensors.clear()
        mapped = getattr(self._map, "_mmap", None)
        self._map = None
        if mapped is not None and unmap:
            try:
                mapped.close()
            except BufferError:  # a view is still alive somewhere: the map goes with it
                pass
