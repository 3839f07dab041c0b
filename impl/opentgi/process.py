"""Process-wide set-up that an opentgi server process (and each of its shard ranks) does before it
loads anything.

Without CUDA, triton is of no use to torch (its CPU code generation is C++) and opentgi compiles no
GPU kernel; but importing transformers' model code imports torch._dynamo, which imports triton
(installed as xgrammar's dependency) only to see whether it is there. Its native library then
stays loaded, and at exit nanobind prints hundreds of lines of "leaked instance ... triton" after a
clean shutdown. On a machine without CUDA the import is refused instead: torch and xgrammar take
the absence of triton as they do on any machine that lacks it. scikit-learn, likewise, is refused
where transformers would import it only for code opentgi never runs.
"""

from __future__ import annotations

import sys


def keep_scikit_learn_out() -> bool:
    """Refuse `import sklearn` in a server process; True when refused. transformers imports
    scikit-learn, wherever it is installed (sentence-transformers brings it), for assisted
    generation's candidate generator, which opentgi never runs: about 2.5 s of every start. A
    process that already imported it, or transformers' generation code, keeps it."""
    if "sklearn" in sys.modules or "transformers.generation.candidate_generator" in sys.modules:
        return False
    sys.modules["sklearn"] = None  # find_spec("sklearn") -> None: transformers takes it as absent
    flags = sys.modules.get("transformers.utils.import_utils")
    if flags is not None and hasattr(flags, "_sklearn_available"):  # probed already: told too
        flags._sklearn_available = False
    return True


def keep_gpu_compilers_out_without_cuda() -> bool:
    """Refuse `import triton` in this process when no CUDA device is usable; True when refused.
    A process that already imported it keeps it."""
    import torch

    if "triton" in sys.modules or torch.cuda.is_available():
        return False
    sys.modules["triton"] = None  # import triton -> ImportError, which torch's probes expect
    return True
