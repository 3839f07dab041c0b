"""Fixtures both suites (tests/ and conformance/) share: the native kernels' cache, the real default
model, loaded once per test process for each setting it is asked in, and one live server on it.

Every test that uses them is marked `slow` (the `ci` tier, not `nox -s tests`) and put in the
`default-model` xdist group, so one worker loads the default model and every such test runs there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import hypothesis_profiles  # noqa: F401 - registers the profiles
from tests.helpers.nodeids import DEFAULT_MODEL_GROUP, set_nodeid, unit_of_work

KERNEL_CACHE = Path(__file__).resolve().parent / ".cache" / "kernels"
DEFAULT_MODEL_FIXTURES = {"default_model", "default_server"}


@pytest.fixture(scope="session", autouse=True)
def kernel_cache() -> Iterator[Path]:
    """Every test process builds or finds the native kernels (opentgi.kernels) in the checkout's
    git-ignored `.cache/kernels`, never in the user's cache: keyed by sources, compiler, flags and
    torch, built once for as long as they stay the same (a concurrent build is safe: kernels/build.py)."""
    from opentgi.kernels.build import CACHE_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(KERNEL_CACHE))
        yield KERNEL_CACHE


@pytest.fixture(scope="session")
def default_model(tmp_path_factory) -> Callable:
    """`default_model(**settings)`: the default model (SmolLM2-135M-Instruct's GGUF) loaded with these
    Settings fields, once per process; one cache dir for the whole session. `default_model.transformers()`:
    transformers' import of the same file, the reference, also once."""
    from opentgi.config import Settings
    from opentgi.models.loader import load_model

    cache_dir = str(tmp_path_factory.mktemp("opentgi-cache"))
    loaded: dict = {}

    def load(**settings):
        key = tuple(sorted(settings.items()))
        if key not in loaded:
            loaded[key] = load_model(Settings(cache_dir=cache_dir, **settings))
        return loaded[key]

    def transformers_model():
        """transformers' own float32 import of the default model's GGUF (the reference), once."""
        if "transformers" not in loaded:
            from opentgi.models.checkpoints.default_model import default_gguf_path
            from opentgi.models.loader import load_transformers_model

            loaded["transformers"] = load_transformers_model(default_gguf_path(), torch.float32)
        return loaded["transformers"]

    load.cache_dir = cache_dir
    load.transformers = transformers_model
    return load


@pytest.fixture(scope="session")
def default_server(default_model) -> Iterator[str]:
    """The base URL of one server on the default model with its default limits (what `opentgi serve`
    starts with no flags), shared by every test of the process that needs one."""
    from conformance.live import free_port, serve
    from opentgi.config import Settings

    settings = Settings(model_id=None, device="cpu", hostname="127.0.0.1", port=free_port(),
                        max_batch_total_tokens=4096, cache_dir=default_model.cache_dir)
    with serve(settings) as base:
        yield base


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group(DEFAULT_MODEL_GROUP))
            # pytest-xdist (--dist loadgroup) marks a group by a node id suffix "@group", set where
            # pytest 9 no longer reads it (`_nodeid`): set here instead, or every worker would load
            # the default model
            if getattr(config.option, "loadgroup", False) and hasattr(item, "_id") and \
                    unit_of_work(item.nodeid) != DEFAULT_MODEL_GROUP:
                set_nodeid(item, f"{item.nodeid}@{DEFAULT_MODEL_GROUP}")
