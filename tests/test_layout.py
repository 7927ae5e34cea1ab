"""The layers run one way: no module imports itself back through others, the runner side never
imports the API side (a runner process stands alone, on any host), and each folder imports only
the folders below it:

    runner.core     runner.core
    runner.policy   runner.core, runner.policy
    runner.sim      runner.core, runner.policy, runner.sim
    runner          runner.core, runner.policy, runner (the runner process; never runner.sim)
    api.client      runner.core, api.client, and the gRPC messages (api.grpc.messages)
    api.bench       runner.core, api.client, api.bench
    api.http        runner.core, runner, api, api.http (the HTTP door: into api's exchange)
    api.grpc        runner.core, runner, api, api.grpc (the gRPC door: into api's exchange)
    api             runner.*, api (the exchange and the processes; never api.client or
                    api.bench), and a door from the modules that open it: api.worker (both
                    doors), api.cli (it checks uvicorn for the HTTP door), api.metric_table
                    (it registers the HTTP door's metrics)

The two doors import the shared exchange (api.service and what it uses), never each other, and
the exchange knows of no door: the gRPC door subclasses it, the HTTP door hands it bodies.
The protocol's gRPC messages (api.grpc.messages and the descriptors it builds them from) import
nothing else of the project, so the client may speak gRPC without the server's door.

Inside runner/ and api/ every import of the project is relative (`from ..core import wire`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runner", "api")

# Each folder, as its dotted name, and the folders its modules may import. The runner process
# (`runner`) and the exchange with its processes (`api`) are the modules directly in runner/ and
# api/.
ALLOWED: dict[str, set[str]] = {
    "batchserve.runner.core": {"batchserve.runner.core"},
    "batchserve.runner.policy": {"batchserve.runner.core", "batchserve.runner.policy"},
    "batchserve.runner.sim": {
        "batchserve.runner.core", "batchserve.runner.policy", "batchserve.runner.sim",
    },
    "batchserve.runner": {
        "batchserve.runner.core", "batchserve.runner.policy", "batchserve.runner",
    },
    "batchserve.api.client": {"batchserve.runner.core", "batchserve.api.client"},
    "batchserve.api.bench": {
        "batchserve.runner.core", "batchserve.api.client", "batchserve.api.bench",
    },
    "batchserve.api.http": {
        "batchserve.runner.core", "batchserve.runner", "batchserve.api", "batchserve.api.http",
    },
    "batchserve.api.grpc": {
        "batchserve.runner.core", "batchserve.runner", "batchserve.api", "batchserve.api.grpc",
    },
    "batchserve.api": {
        "batchserve.runner.core", "batchserve.runner.policy", "batchserve.runner.sim",
        "batchserve.runner", "batchserve.api", "batchserve.api.http", "batchserve.api.grpc",
    },
}
DOORS = ("batchserve.api.http", "batchserve.api.grpc")
MESSAGES = {"batchserve.api.grpc.messages", "batchserve.api.grpc.descriptor"}
"""The gRPC protocol's messages, which import nothing else of the project."""
SPEAK_GRPC = {"batchserve.api.client", "batchserve.api.bench"}
"""The folders besides the gRPC door that may import `MESSAGES`."""
OPENS_THE_DOORS = {
    "batchserve.api.worker": {"batchserve.api.http", "batchserve.api.grpc"},
    "batchserve.api.cli": {"batchserve.api.http"},
    "batchserve.api.metric_table": {"batchserve.api.http"},
}
"""The modules of api/ that may import a door's folder, and the doors each imports."""


def module_files() -> dict[str, Path]:
    """Every module under runner/ and api/, folders included, by its installed name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT / package).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("batchserve", package, *parts))] = path
    return found


def package_of(name: str, path: Path) -> str:
    """The package a relative import in module `name` (read from `path`) starts from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported(name: str, path: Path) -> set[str]:
    """The dotted names `path` imports, at its top or inside a function, relative imports
    resolved: for `from X import y`, both X and X.y (y may be a module or a name in X)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(name, path).split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports."""
    files = module_files()
    return {name: imported(name, path) & files.keys() for name, path in files.items()}


def folder_of(module: str, packages: set[str]) -> str:
    """The package folder a module (or package) belongs to: the longest of `packages` that is
    the module's own package (for a package, itself)."""
    parent = module
    while parent not in packages:
        parent = parent.rpartition(".")[0]
    return parent


def package_names() -> set[str]:
    return {name for name, path in module_files().items() if path.name == "__init__.py"}


def crossings(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """The imports that break `ALLOWED`, by the importing module."""
    packages = package_names()
    found: dict[str, list[str]] = {}
    for name, targets in graph.items():
        folder = folder_of(name, packages)
        bad = sorted(t for t in targets if folder_of(t, packages) not in ALLOWED[folder]
                     and not (t in MESSAGES and folder in SPEAK_GRPC))
        if bad:
            found[name] = bad
    return found


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


def test_every_module_was_read() -> None:
    graph = import_graph()
    assert len(graph) > 50
    assert package_names() == ALLOWED.keys()
    # relative imports resolve to modules that exist, one and two levels up
    assert "batchserve.runner.core.config" in graph["batchserve.runner.dispatcher"]
    assert "batchserve.runner.core.wire" in graph["batchserve.api.http.app"]
    assert "batchserve.api.service" in graph["batchserve.api.http.connection"]
    assert "batchserve.runner.core.types" in graph["batchserve.api.client.client"]


def test_the_import_graph_has_no_cycle() -> None:
    assert cycle_in(import_graph()) is None


def test_the_cycle_finder_finds_one() -> None:
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_the_runner_never_imports_the_api() -> None:
    crossing = {
        name: sorted(target for target in targets if target.startswith("batchserve.api"))
        for name, targets in import_graph().items()
        if name.startswith("batchserve.runner")
    }
    assert {name: found for name, found in crossing.items() if found} == {}


def test_each_folder_imports_only_the_folders_below_it() -> None:
    assert crossings(import_graph()) == {}


def test_only_the_processes_open_the_doors() -> None:
    """The exchange and the supervisor never import a door: requests come in through
    `api.service` from either, and only the worker process starts them. The client and the
    bench take the gRPC messages alone."""
    packages = package_names()
    opening = {}
    for name, targets in import_graph().items():
        folder = folder_of(name, packages)
        if folder in DOORS or folder in SPEAK_GRPC:
            continue
        doors = {door for door in DOORS
                 if any(folder_of(target, packages) == door for target in targets)}
        if doors:
            opening[name] = doors
    assert opening == OPENS_THE_DOORS


def test_the_doors_never_import_each_other() -> None:
    packages = package_names()
    crossing = {
        name: sorted(t for t in targets if folder_of(t, packages) in DOORS
                     and folder_of(t, packages) != folder_of(name, packages))
        for name, targets in import_graph().items() if folder_of(name, packages) in DOORS
    }
    assert {name: found for name, found in crossing.items() if found} == {}


def test_the_grpc_messages_import_only_each_other() -> None:
    graph = import_graph()
    assert {name: graph[name] - MESSAGES for name in MESSAGES} == dict.fromkeys(MESSAGES, set())


@pytest.mark.parametrize(("importer", "target"), [
    ("batchserve.runner.core.wire", "batchserve.runner.policy.base"),
    ("batchserve.runner.policy.adaptive", "batchserve.runner.sim.scenario"),
    ("batchserve.runner.sim.simulate", "batchserve.runner.dispatcher"),
    ("batchserve.runner.server", "batchserve.runner.sim.simulate"),
    ("batchserve.runner.server", "batchserve.api.http.app"),
    ("batchserve.api.client.codec", "batchserve.runner.policy.base"),
    ("batchserve.api.client.client", "batchserve.api.errors"),
    ("batchserve.api.client.grpc_codec", "batchserve.api.grpc.codec"),
    ("batchserve.api.bench.loadgen", "batchserve.api.http.app"),
    ("batchserve.api.bench.probe", "batchserve.runner.metrics"),
    ("batchserve.api.http.app", "batchserve.api.bench.loadgen"),
    ("batchserve.api.http.app", "batchserve.api.grpc.server"),
    ("batchserve.api.grpc.server", "batchserve.api.http.connection"),
    ("batchserve.api.dispatch", "batchserve.api.client.codec"),
    ("batchserve.api.grpc.door", "batchserve.api.client.codec"),
    ("batchserve.api.grpc.server", "batchserve.runner.policy.base"),
])
def test_an_import_against_the_grain_is_caught(importer: str, target: str) -> None:
    graph = import_graph()
    assert crossings(graph) == {}
    graph[importer].add(target)
    assert crossings(graph) == {importer: [target]}


def test_relative_imports_resolve_from_the_module_or_package() -> None:
    path = ROOT / "runner" / "sim" / "simulate.py"
    assert package_of("batchserve.runner.sim.simulate", path) == "batchserve.runner.sim"
    init = ROOT / "api" / "client" / "__init__.py"
    assert package_of("batchserve.api.client", init) == "batchserve.api.client"
    assert "batchserve.api.client.client.ModelClient" in imported("batchserve.api.client", init)


def test_every_folder_says_what_it_owns() -> None:
    inits = [path for path in module_files().values() if path.name == "__init__.py"]
    inits += [ROOT / "benchmarks" / "__init__.py", ROOT / "benchmarks" / "peers" / "__init__.py"]
    missing = [
        str(path.relative_to(ROOT)) for path in inits
        if not path.exists() or not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert missing == []


def test_the_package_imports_itself_relatively() -> None:
    absolute = {
        str(path.relative_to(ROOT)): [
            node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if (isinstance(node, ast.ImportFrom) and node.level == 0
                and (node.module or "").split(".")[0] == "batchserve")
            or (isinstance(node, ast.Import)
                and any(alias.name.split(".")[0] == "batchserve" for alias in node.names))
        ]
        for path in module_files().values()
    }
    assert {path: lines for path, lines in absolute.items() if lines} == {}
