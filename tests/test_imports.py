"""The package's import directions (``docs/architecture.md``), checked by an AST scan.

- core (every module directly under ``shmbuffer/`` and ``shmbuffer/samplers/``, except the
  layers above both sides) imports neither ``shmbuffer.daemon`` nor ``shmbuffer.clients``;
- ``daemon/`` never imports ``clients/`` and ``clients/`` never imports ``daemon/``;
- interop layers (``shmbuffer.torchrl``) sit above the clients: core and clients, never the
  daemon;
- the Ray scale-out (``shmbuffer.cluster``) sits above the clients too: it runs daemons as
  ``shmbuffer-daemon start`` subprocesses, never by importing ``shmbuffer.daemon``;
- no import circle anywhere, counting lazy imports and ``TYPE_CHECKING`` ones alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shmbuffer"
#: Modules above both sides: the command line launches the daemon and is its client (cli.py
#: the parser and entry point, cli_start.py the daemon it runs, cli_admin.py the commands that
#: talk to it); the demo runs both (cli_demo.py the command, demo.py its processes' loops);
#: the package root only hands names on, lazily.
ABOVE_BOTH = {
    "shmbuffer",
    "shmbuffer.cli",
    "shmbuffer.cli_admin",
    "shmbuffer.cli_demo",
    "shmbuffer.cli_start",
    "shmbuffer.demo",
}
#: Packages above the clients only: adapters that give other libraries' APIs a daemon's buffer
#: through Reader and Writer (TorchRL's Storage/Writer/Sampler); a job's processes are clients.
INTEROP = {"shmbuffer.torchrl"}
#: Above the clients only: the Ray scale-out's hosts launch the daemon through the command line
#: (a subprocess), so a shard's daemon is a process apart, never imported.
CLUSTER = {"shmbuffer.cluster"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports anywhere in its body (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from shmbuffer import rows` imports the module shmbuffer.rows
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            known = name
            while known and known not in modules:
                known = known.rpartition(".")[0]
            if known:
                found.add(known)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph = {m: imports_of(p, modules) - {m} for m, p in paths.items()}
    # A package's __init__ is imported with any of its modules; the root is lazy on purpose.
    return {m: {d for d in deps if d != "shmbuffer"} for m, deps in graph.items()}


def side(module: str) -> str:
    if module in ABOVE_BOTH:
        return "above"
    if any(module == name or module.startswith(f"{name}.") for name in INTEROP):
        return "interop"
    if any(module == name or module.startswith(f"{name}.") for name in CLUSTER):
        return "cluster"
    for name in ("daemon", "clients"):
        if module == f"shmbuffer.{name}" or module.startswith(f"shmbuffer.{name}."):
            return name
    return "core"


GRAPH = import_graph()


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_import_direction(module: str) -> None:
    allowed = {
        "core": {"core"},
        "daemon": {"core", "daemon"},
        "clients": {"core", "clients"},
        "interop": {"core", "clients", "interop"},
        "cluster": {"core", "clients", "cluster"},
        "above": {"core", "daemon", "clients", "above"},
    }[side(module)]
    wrong = sorted(dep for dep in GRAPH[module] if side(dep) not in allowed)
    assert not wrong, f"{module} ({side(module)}) must not import {wrong}"


def test_no_import_circles() -> None:
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            pytest.fail("import circle: " + " -> ".join(cycle))
        if module in done:
            return
        path.append(module)
        for dep in sorted(GRAPH[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(GRAPH):
        visit(module)


def test_the_scan_sees_imports() -> None:
    # guards the test itself: a scanner that found nothing would pass everything above
    assert "shmbuffer.daemon.service" in GRAPH["shmbuffer.daemon.server"]
    assert "shmbuffer.clients.connection" in GRAPH["shmbuffer.clients.admin"]
    assert side("shmbuffer.daemon.service") == "daemon"
    assert side("shmbuffer.registry") == "core"
    assert side("shmbuffer.torchrl.storage") == "interop"
    assert "shmbuffer.clients.reader" in GRAPH["shmbuffer.torchrl.storage"]
    assert side("shmbuffer.cluster.reader") == "cluster"
    assert "shmbuffer.clients.reader" in GRAPH["shmbuffer.cluster.fanout"]


def test_only_the_interop_layer_imports_torchrl() -> None:
    # `import shmbuffer` (and every client) must work without the torchrl extra
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        if side(module) == "interop":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            wrong = [n for n in names if n == "torchrl" or n.startswith("torchrl.")]
            assert not wrong, f"{module} imports {wrong[0]}: only shmbuffer.torchrl may"


def test_only_the_cluster_imports_ray() -> None:
    # `import shmbuffer` (and every client) must work without the ray extra
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        if side(module) == "cluster":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            wrong = [n for n in names if n == "ray" or n.startswith("ray.")]
            assert not wrong, f"{module} imports {wrong[0]}: only shmbuffer.cluster may"
