"""glibc malloc keeps what a step frees once an engine is built (engine/execution/host_memory.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# In a fresh interpreter: malloc 16 MiB, write it, free it; print the resident memory it left behind.
PROBE = """
import ctypes
if {keep}:
    from opentgi.engine.execution.host_memory import keep_freed_memory
    assert keep_freed_memory()
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = rss()
p = libc.malloc(16 << 20)
ctypes.memset(p, 1, 16 << 20)
libc.free(p)
print(rss() - before)
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


def _left_resident(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE.format(keep=keep)], capture_output=True, text=True,
                         check=True, env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))})
    return int(out.stdout)


@glibc_only
def test_freed_step_memory_stays_in_the_process():
    assert _left_resident(keep=False) < 4 << 20  # glibc's default: a 16 MiB block is unmapped on free
    assert _left_resident(keep=True) >= 15 << 20  # kept for the next step, no page faults to refill


def test_user_malloc_settings_are_left_alone(monkeypatch):
    from opentgi.engine.execution import host_memory
    monkeypatch.setattr(host_memory, "_done", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert host_memory.keep_freed_memory() is False
