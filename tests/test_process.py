"""A server process's set-up (opentgi/process.py), each case in a fresh interpreter: scikit-learn is
refused before transformers can import it for code opentgi never runs, and transformers' model and
generation code still import and work; a process that already has it keeps it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

IMPL = Path(__file__).resolve().parents[1] / "impl"


def run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(IMPL), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.slow  # an interpreter that imports transformers' model and generation code
def test_a_server_process_never_imports_scikit_learn_and_transformers_still_generates():
    out = run("""
        import sys
        from opentgi.process import keep_scikit_learn_out
        assert keep_scikit_learn_out()
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # generation code too
        from transformers.utils import is_sklearn_available
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2)).eval()
        # exactly 3 new tokens: the random model may pick its EOS id (2) first
        tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
        print(sys.modules.get("sklearn"), is_sklearn_available(), tokens.shape[1])
    """)
    assert out == "None False 6"


@pytest.mark.slow  # an interpreter that imports transformers' generation code
def test_after_transformers_looked_for_it_the_refusal_tells_transformers_too():
    out = run("""
        import sys
        import transformers.utils.import_utils as flags
        from opentgi.process import keep_scikit_learn_out
        assert keep_scikit_learn_out()
        import transformers.generation.candidate_generator
        print(sys.modules.get("sklearn"), flags.is_sklearn_available())
    """)
    assert out == "None False"


def test_a_process_that_imported_it_keeps_it():
    out = run("""
        import sys, types
        sys.modules["sklearn"] = mine = types.ModuleType("sklearn")  # imported before the set-up
        from opentgi.process import keep_scikit_learn_out
        assert not keep_scikit_learn_out()
        print("kept" if sys.modules["sklearn"] is mine else "lost")
    """)
    assert out == "kept"
