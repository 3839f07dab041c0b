"""Process-wide set-up that an opentgi server process (and each of its shard ranks) does before it
loads anything.

Without CUDA, triton is of no use to torch (its CPU code generation is C++) and opentgi compiles no
GPU kernel; but importing transformers' model code imports torch._dynamo, which imports triton
(installed as xgrammar's dependency) only to see whether it is there. Its native library then
stays loaded, and at exit nanobind prints hundreds of lines of "leaked instance ... triton" after a
clean shutdown. On a machine without CUDA the import is refused instead: torch and xgrammar take
the absence of triton as they do on any machine that lacks it.
"""

from __future__ import annotations

import sys


def keep_gpu_compilers_out_without_cuda() -> bool:
    """Refuse `import triton` in this process when no CUDA device is usable; True when refused.
    A process that already imported it keeps it."""
    import torch

    if "triton" in sys.modules or torch.cuda.is_available():
        return False
    sys.modules["triton"] = None  # import triton -> ImportError, which torch's probes expect
    return True
