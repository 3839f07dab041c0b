"""The package's layout shows its architecture: folders named after one concept each hold about a
dozen modules at most, no module is over 600 lines, no module imports another's private (`_x`)
names, and no module imports, directly or through others, one that imports it back (function-level
imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "impl" / "opentgi"
MAX_MODULES_PER_FOLDER = 12
MAX_MODULE_LINES = 600
# Generated from openapi/ by codegen: as long as the document it mirrors, never edited by hand.
GENERATED = {"opentgi/schemas/tgi.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_folder_holds_more_than_a_dozen_modules():
    crowded = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(PACKAGE.parent))] = len(modules)
    assert crowded == {}


def test_no_module_is_over_600_lines():
    oversized = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
                 if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert set(oversized) <= GENERATED, oversized


def private_imports() -> set[tuple[str, str, str]]:
    """(importing module, imported module, name) of every `from opentgi... import _name`."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opentgi"):
                found.update((module_name(path), node.module, alias.name) for alias in node.names
                             if alias.name.startswith("_") and not alias.name.startswith("__"))
    return found


def test_no_module_imports_a_private_name_of_another():
    assert private_imports() == set()


def test_no_import_circle():
    assert import_cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_engine_and_models_never_import_the_api():
    graph = import_graph()
    leaks = {name: sorted(d for d in deps if d.startswith(("opentgi.api", "opentgi.schemas")))
             for name, deps in graph.items() if name.startswith(("opentgi.engine", "opentgi.models"))}
    assert {name: deps for name, deps in leaks.items() if deps} == {}
