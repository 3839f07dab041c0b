"""A live server for the conformance suites: the tiny Llama behind the real app, served by uvicorn.

`live_server` is the base URL ("http://127.0.0.1:PORT") of one server per test session, started in
a background thread on a free port. Its limits are small so property tests stay fast on 2 cores.
`live_settings` holds the Settings it runs with.

`pytest conformance --server-url http://host:port` runs the live-server tests against a server
already running instead (another build, or another implementation of the APIs); start it on the
same model and limits as `live_settings` (the tiny Llama's folder: `python -m tests.helpers.tiny_models`).
Tests that start servers of their own still do.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from conformance.live import LIVE_MAX_INPUT_TOKENS, LIVE_MAX_TOTAL_TOKENS, free_port, serve
from opentgi.config import Settings
from tests.helpers import tiny_models
from tests.helpers.nodeids import DEFAULT_MODEL_GROUP, set_nodeid, unit_of_work

torch.set_num_threads(1)  # CI has 2 cores and other suites run beside this one



@pytest.fixture(scope="session")
def live_settings() -> Settings:
    return Settings(
        model_id=str(tiny_models.tiny_llama_path()),
        device="cpu",
        hostname="127.0.0.1",
        port=free_port(),
        max_input_tokens=LIVE_MAX_INPUT_TOKENS,
        max_total_tokens=LIVE_MAX_TOTAL_TOKENS,
        max_batch_total_tokens=16 * LIVE_MAX_TOTAL_TOKENS,
        max_concurrent_requests=64,
    )


def pytest_addoption(parser):
    parser.addoption("--server-url", default=None,
                     help="run the live-server tests against this running server instead of starting one")


def pytest_collection_modifyitems(items):
    """schemathesis names each operation's test `test_tgi[POST /generate]`, but under pytest 9 every
    operation of a document gets the document's one node id. pytest-xdist keys tests by node id (it
    would run one operation per document) and so do `-k`/`--deselect`: give each its own."""
    for item in items:
        if getattr(item, "operation_label", None) and not item.nodeid.endswith("]"):
            set_nodeid(item, f"{item.parent.nodeid}::{item.name}")
    seen: set[str] = set()
    repeated = sorted({item.nodeid for item in items if item.nodeid in seen or seen.add(item.nodeid)})
    if repeated:  # xdist would run one of each silently
        raise pytest.UsageError(f"tests share node ids: {repeated[:5]}")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown, and unused, without it
def pytest_xdist_make_scheduler(config, log):
    """With `-n`: a module's tests stay on one worker (its module-scoped engine is built once), but
    each schemathesis operation is a unit of its own, so the longest module spreads over the workers;
    and, as `--dist loadgroup` does, an `xdist_group`'s tests are one unit (the default model's)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrOperation(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

        def _assign_work_unit(self, node) -> None:
            # the default model's unit is the longest by far (it loads the model several ways):
            # started first, the other worker fills the time beside it instead of waiting at the end
            if DEFAULT_MODEL_GROUP in self.workqueue:
                self.workqueue.move_to_end(DEFAULT_MODEL_GROUP, last=False)
            super()._assign_work_unit(node)

    return ModuleOrOperation(config, log)


@pytest.fixture(scope="session")
def live_server(request, live_settings: Settings) -> Iterator[str]:
    url = request.config.getoption("--server-url")
    if url:
        yield url.rstrip("/")
        return
    with serve(live_settings, startup_timeout_s=120) as url:
        yield url
