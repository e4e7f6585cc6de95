"""The package's rooms and their import directions (``docs/architecture.md``), by an AST scan.

Each module belongs to one room; a room imports only itself and the rooms below it (``BELOW``).
From the bottom up:

- the base, directly under ``shmbuffer/``: ``errors``, ``names``, ``jit``, ``runtime``;
- ``storage/`` (rows in memory), ``wire/`` (what crosses a socket) and ``registry/`` (the
  episode interval registry), side by side, each over the base only;
- ``samplers/`` over the registry; ``api/`` (the public API's rules: argument checks, write
  plans, episode assembly, hooks) over those; ``ring/`` (the ring and its tables, which
  enforce the rules) over all of them;
- the front ends: ``buffer.py`` in process and ``weights.py``; ``daemon/`` and ``clients/``,
  which never import each other; ``torchrl/`` and ``cluster/`` over the clients (a cluster
  runs daemons as ``shmbuffer-daemon start`` subprocesses, never by importing them);
- ``offline/`` (datasets in and out: reads checkpoints, asks a daemon for one, loads a dataset
  into a daemon's service), over both sides;
- ``cli/``, above both sides and ``offline/``, and the package root, which only hands names
  on, lazily.

``shmbuffer.protocol`` and ``shmbuffer.segment`` are public import paths kept as thin
re-exports of ``wire/`` and ``storage/``; nothing inside the package imports through them.
No import circle anywhere, counting lazy imports and ``TYPE_CHECKING`` ones alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shmbuffer"
BASE = {"errors", "names", "jit", "runtime"}
#: Public import paths that only re-export another room's module.
PUBLIC_PATHS = {"shmbuffer.protocol": "wire", "shmbuffer.segment": "storage"}
_CORE = {"base", "storage", "wire", "registry", "samplers", "ring", "api"}
#: What each room may import besides itself.
BELOW: dict[str, set[str]] = {
    "base": set(),
    "storage": {"base"},
    "wire": {"base"},
    "registry": {"base"},
    "samplers": {"base", "registry"},
    "api": {"base", "registry", "samplers", "storage", "wire"},
    "ring": {"base", "api", "registry", "samplers", "storage", "wire"},
    "front": _CORE,
    "daemon": _CORE,
    "clients": _CORE | {"front"},
    "torchrl": _CORE | {"front", "clients"},
    "cluster": _CORE | {"clients"},
    "offline": _CORE | {"daemon", "clients"},
    "cli": _CORE | {"front", "daemon", "clients", "offline"},
    "root": _CORE | {"front", "daemon", "clients", "torchrl", "cluster", "offline", "cli"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """The room ``module`` lives in (a public path counts as the room it re-exports)."""
    if module in PUBLIC_PATHS:
        return PUBLIC_PATHS[module]
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] in BASE:
        return "base"
    if parts[1] in BELOW:
        return parts[1]
    return "front"  # buffer.py, weights.py: the modules left directly under shmbuffer/


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports anywhere in its body (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from shmbuffer.storage import rows` imports the module shmbuffer.storage.rows
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
    # A package's __init__ is imported with any of its modules (a module naming its own
    # package is no edge); the root is lazy on purpose.
    return {
        m: {d for d in deps if d != "shmbuffer" and not m.startswith(f"{d}.")}
        for m, deps in graph.items()
    }


GRAPH = import_graph()


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_import_direction(module: str) -> None:
    mine = room(module)
    allowed = BELOW[mine] | {mine}
    wrong = sorted(dep for dep in GRAPH[module] if room(dep) not in allowed)
    assert not wrong, f"{module} ({mine}) must not import {wrong}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m not in PUBLIC_PATHS))
def test_nothing_imports_through_a_public_path(module: str) -> None:
    # inside the package a module names a room's module, so `ls` shows who depends on what
    wrong = sorted(GRAPH[module] & set(PUBLIC_PATHS))
    assert not wrong, f"{module} imports {wrong}: import the room's module instead"


def test_public_paths_are_the_rooms_modules() -> None:
    import shmbuffer.protocol
    import shmbuffer.segment
    import shmbuffer.storage.segment
    import shmbuffer.wire.protocol

    assert shmbuffer.segment.Segment is shmbuffer.storage.segment.Segment
    assert shmbuffer.protocol.PROTOCOL_VERSION == shmbuffer.wire.protocol.PROTOCOL_VERSION
    assert shmbuffer.protocol.encode is shmbuffer.wire.protocol.encode


def test_every_module_has_a_room() -> None:
    # a new module directly under shmbuffer/ lands in "front" unless it is named here
    top = sorted(m for m in GRAPH if m.count(".") == 1 and room(m) == "front")
    assert top == ["shmbuffer.buffer", "shmbuffer.weights"], top


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
    assert room("shmbuffer.daemon.service") == "daemon"
    assert room("shmbuffer.registry.intervals") == "registry"
    assert room("shmbuffer.errors") == "base"
    assert room("shmbuffer.torchrl.storage") == "torchrl"
    assert "shmbuffer.clients.reader" in GRAPH["shmbuffer.torchrl.storage"]
    assert room("shmbuffer.cluster.reader") == "cluster"
    assert "shmbuffer.clients.reader" in GRAPH["shmbuffer.cluster.fanout"]
    assert "shmbuffer.samplers" in GRAPH["shmbuffer.ring.table"]
    assert room("shmbuffer.ring.table") == "ring"
    assert room("shmbuffer.segment") == "storage"


def _third_party(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


@pytest.mark.parametrize(("library", "home"), [("torchrl", "torchrl"), ("ray", "cluster")])
def test_only_its_room_imports_an_extra(library: str, home: str) -> None:
    # `import shmbuffer` (and every client) must work without the torchrl and ray extras
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        if room(module) == home:
            continue
        wrong = [n for n in _third_party(path) if n == library or n.startswith(f"{library}.")]
        assert not wrong, f"{module} imports {wrong[0]}: only shmbuffer.{home} may"
