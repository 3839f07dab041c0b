"""Keep the memory a step frees in the process, for the next step to reuse without page faults.

glibc's malloc hands freed memory back to the operating system: a block above its mmap threshold
is unmapped at once, and free space at the top of a heap past the trim threshold is given back.
A decode step allocates and frees the same few-MiB tensors every time (a batch of 64 rows' logits
alone is 12 MiB in float32), so its next allocation of them faults every page in again, and the
steps that fault are markedly slower than those that do not (figures: docs/cpu.md).

`keep_freed_memory` raises both thresholds once per process, when an engine is built (glibc only;
a no-op elsewhere, and where the user tuned malloc through its environment variables). The cost is
resident memory that stays at the largest step's working set instead of shrinking after it.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): bigger blocks are still mapped
TRIM_THRESHOLD = 512 << 20
USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc malloc's mmap and trim thresholds (once); True when they are set."""
    global _done
    if _done:
        return True
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.debug("mallopt refused the thresholds; freed memory goes back to the OS as before")
    return _done
