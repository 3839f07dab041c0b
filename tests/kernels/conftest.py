"""The native kernels, built (or found in the tests' kernel cache: the root conftest.py) and loaded
once per session."""

from __future__ import annotations

import pytest

from opentgi.kernels import native


@pytest.fixture(scope="session")
def kernels() -> native.KernelPath:
    """Built (or found) and loaded: a machine that runs these tests must build them."""
    return native.load("native")
