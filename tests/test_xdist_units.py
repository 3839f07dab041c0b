"""How the suites spread over pytest-xdist workers (conformance/conftest.py's scheduler): a module's tests stay
together, each schemathesis operation goes alone, and the default model's tests form one unit, so
one worker loads it; on pytest 9 that group's node id suffix is set where pytest reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.nodeids import unit_of_work

ROOT = Path(__file__).resolve().parents[1]


def test_units_are_groups_then_operations_then_modules():
    assert unit_of_work("tests/engine/test_engine_generate.py::test_default_model_greedy_equals_generate"
                        "@default-model") == "default-model"
    assert unit_of_work("tests/models/test_models_dtype.py::test_x[a-b]@default-model") == "default-model"
    assert unit_of_work("tests/models/test_models_dtype.py::test_cpu_has_bf16_reads_the_flags[a@b-True]") \
        == "tests/models/test_models_dtype.py"
    op = "conformance/test_schemathesis_tgi.py::test_tgi[POST /generate]"
    assert unit_of_work(op) == op
    assert unit_of_work("tests/test_layout.py::test_no_import_circle") == "tests/test_layout.py"


@pytest.mark.slow  # a pytest run with an xdist worker in a subprocess
def test_under_loadgroup_the_default_models_tests_carry_their_group(tmp_path):
    """Collected by an xdist worker with --dist loadgroup, every test of the default-model group
    has the "@default-model" suffix the scheduler reads, and the others do not."""
    plugin = tmp_path / "report_ids.py"
    plugin.write_text(
        "import os, pytest\n"
        "@pytest.hookimpl(trylast=True)\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    if os.environ.get('PYTEST_XDIST_WORKER'):\n"
        f"        open({str(tmp_path / 'ids.txt')!r}, 'w').write('\\n'.join(i.nodeid for i in items))\n"
        "    items[:] = []\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "report_ids", "-q", "-n", "1",
         "--dist", "loadgroup", "tests/models/test_models_dtype.py", "-k", "bfloat16_greedy or reads_the_flags"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "impl"), str(ROOT)])})
    ids = (tmp_path / "ids.txt").read_text().splitlines() if (tmp_path / "ids.txt").exists() else []
    assert len(ids) == 5, done.stdout[-2000:] + done.stderr[-2000:]
    grouped = [i for i in ids if i.endswith("@default-model")]
    assert grouped == ["tests/models/test_models_dtype.py::"
                       "test_default_model_bfloat16_greedy_agrees_with_float32_except_near_ties@default-model"]
    assert all("@" not in i for i in ids if i not in grouped)
