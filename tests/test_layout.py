"""The layers run one way: no module imports itself back through others, and the runner side
never imports the API side (a runner process stands alone, on any host)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runner", "api")


def imports_of(path: Path) -> set[str]:
    """The project's modules that `path` imports, at its top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        module = node.module if isinstance(node, ast.ImportFrom) else None
        if module and module.startswith("batchserve."):
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("batchserve."))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {
        f"batchserve.{package}.{path.stem}": path
        for package in PACKAGES
        for path in (ROOT / package).glob("*.py")
    }
    return {name: imports_of(path) & modules.keys() for name, path in modules.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            cycle = visit(target, path + [name])
            if cycle:
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle:
            return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40  # every module was read
    assert cycle_in(graph) is None


def test_the_cycle_finder_finds_one() -> None:
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_the_runner_never_imports_the_api() -> None:
    crossing = {
        name: sorted(target for target in targets if target.startswith("batchserve.api."))
        for name, targets in import_graph().items()
        if name.startswith("batchserve.runner.")
    }
    assert {name: found for name, found in crossing.items() if found} == {}
