"""Which kernel keeps rows invariant for each weight shape: found by start-up probes (linear.py,
adapter_lora.py), kept between starts.

A probe runs a few hundred matmuls per weight shape, a noticeable part of a large model's start.
Its answer depends only on the shape, the dtype, the kernels torch picks on this CPU and the thread
count, so it is written to one small JSON file under `--cache-dir`, named by a fingerprint of
torch's version, the CPU's model name and instruction flags and the thread count; a later start
on the same machine reads it back instead of probing. A missing, damaged or unwritable file means
probing again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def machine_fingerprint(cpuinfo: str | None = None) -> str:
    """torch's version, the CPU's model and flags, the thread count: what the probes' answers
    depend on besides the weight's shape and dtype."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    lines = sorted({line.strip() for line in cpuinfo.splitlines() if line.startswith(("model name", "flags"))})
    text = "\n".join([torch.__version__, str(torch.get_num_threads()), *lines])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class KernelChoiceCache(dict):
    """A dict of probe answers (key: a tuple of the shape, dtype, ...; value: a JSON value). With a
    file attached (`attach`), entries found there are read back and every new one is written."""

    def __init__(self) -> None:
        super().__init__()
        self.path: Path | None = None
        self._stored: dict[str, object] = {}

    def attach(self, cache_dir: Path, fingerprint: str | None = None) -> None:
        self.path = Path(cache_dir) / "measured" / f"row-invariant-forms-{fingerprint or machine_fingerprint()}.json"
        try:
            stored = json.loads(self.path.read_text(encoding="utf-8"))
            self._stored = stored if isinstance(stored, dict) else {}
        except (OSError, ValueError):
            self._stored = {}

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        if self.path is not None and repr(key) in self._stored:
            dict.__setitem__(self, key, self._stored[repr(key)])
            return True
        return False

    def __setitem__(self, key: object, value: object) -> None:
        dict.__setitem__(self, key, value)
        if self.path is None or self._stored.get(repr(key), object()) == value:
            return
        self._stored[repr(key)] = value
        tmp = self.path.with_name(f".tmp-{self.path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._stored, indent=0, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:  # a read-only or full cache: the next start probes again
            log.warning("could not write %s", self.path, exc_info=True)
        finally:
            tmp.unlink(missing_ok=True)
