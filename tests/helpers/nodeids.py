"""Node ids for pytest-xdist: giving a collected test another node id from a conftest hook (pytest 9
keeps a parsed NodeId in `_id`, what `nodeid` reads; earlier versions the string in `_nodeid`), and
the unit of work a node id is scheduled in (conformance/conftest.py's scheduler)."""

from __future__ import annotations

DEFAULT_MODEL_GROUP = "default-model"  # the xdist_group of every test on the real default model (conftest.py)


def set_nodeid(item, wanted: str) -> None:
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(wanted)
    else:
        item._nodeid = wanted
    assert item.nodeid == wanted, (item.nodeid, wanted)


def unit_of_work(nodeid: str) -> str:
    """A test's scheduling unit: its xdist_group (a node id suffix "@group" under --dist loadgroup),
    else its schemathesis operation, else its module."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[1]
    module, _, _ = nodeid.partition("::")
    return nodeid if module.endswith("test_schemathesis_tgi.py") else module
