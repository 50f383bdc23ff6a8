"""The import direction between the top-level packages, checked on every module's syntax tree.

registry and transfer are the ground floor, router and worker stand on them (the router uses
only ``transfer.events``, the KV cache event feed it follows, never the engine-side KV path);
test support (``testkit``) serves ``tests`` and ``bench`` and nothing in the product imports it;
no test imports a benchmark (the benchmarks' own tests live in ``bench/tests``), and nothing
outside ``tests`` imports ``tests``. Function-level imports count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("router", "registry", "transfer", "worker")
PACKAGES = (*PRODUCT, "testkit", "bench", "tests")

# importer package -> top-level packages it must not import
FORBIDDEN: dict[str, frozenset[str]] = {
    "registry": frozenset({"router", "transfer", "worker", "testkit", "bench", "tests"}),
    "transfer": frozenset({"router", "worker", "testkit", "bench", "tests"}),
    "router": frozenset({"transfer", "worker", "testkit", "bench", "tests"}),
    "worker": frozenset({"router", "testkit", "bench", "tests"}),
    "testkit": frozenset({"bench", "tests"}),
    "bench": frozenset({"tests"}),
    "tests": frozenset({"bench"}),
}


# importer package -> modules it may import although their package is forbidden
ALLOWED: dict[str, tuple[str, ...]] = {"router": ("transfer.events",)}


def imported_modules(source: str) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _allowed(package: str, module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in ALLOWED.get(package, ()))


def violations(root: Path, package: str) -> list[str]:
    """``path:line imports X`` for every forbidden import under ``root/package``."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        banned = FORBIDDEN[package]
        for line, module in imported_modules(path.read_text()):
            imported = module.split(".")[0]
            if imported in banned and not _allowed(package, module):
                found.append(f"{path.relative_to(root)}:{line} imports {imported}")
    return found


def test_a_forbidden_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "x.py").write_text(
        "def f():\n    from testkit.polling import wait_until\n"
    )
    assert violations(tmp_path, "router") == ["router/x.py:2 imports testkit"]


def test_the_router_may_follow_kv_events_but_not_move_kv(tmp_path: Path) -> None:
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "x.py").write_text(
        "from transfer.events import KVEventSubscriber\nfrom transfer.sender import KVSender\n"
    )
    assert violations(tmp_path, "router") == ["router/x.py:2 imports transfer"]


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layering(package: str) -> None:
    assert violations(ROOT, package) == []


# ---------------------------------------------------------------------------- router's rooms

# router's subpackages ("rooms") and the rooms each may import. The top level holds the shared
# vocabulary (errors, types, settings, schemas, workers, interrupt, kv_tiers: they import no
# room) and the composition root (app, context with sharing, its wiring of what a router shares
# with its host's processes and its replicas, __main__, __init__: they may import any room;
# ``api`` may import ``context``, the lifespan-owned context it serves requests with).
ROOM_IMPORTS: dict[str, frozenset[str]] = {
    "adapters": frozenset(),
    "upstream": frozenset(),
    "kv_cache": frozenset(),
    "tenancy": frozenset(),
    "fleet": frozenset({"upstream"}),
    "observability": frozenset({"fleet", "kv_cache", "upstream"}),
    "scheduling": frozenset({"kv_cache", "fleet", "upstream", "observability"}),
    "pipeline": frozenset({"adapters", "scheduling", "upstream", "fleet", "observability"}),
    "server": frozenset({"scheduling", "upstream"}),
    "api": frozenset(
        {"context", "pipeline", "observability", "kv_cache", "scheduling", "fleet", "tenancy"}
    ),
}
COMPOSITION_ROOT = frozenset({"app", "context", "sharing", "__main__", "__init__"})


def _room_of(module: str) -> str:
    """The room of a ``router.*`` module: its subpackage, or its own name at the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_violations(root: Path) -> list[str]:
    """``path:line: room imports room`` for every import between router's rooms that the
    table above does not allow."""
    found = []
    for path in sorted((root / "router").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        importer = _room_of(".".join(parts))
        if importer in COMPOSITION_ROOT:
            continue
        allowed = ROOM_IMPORTS.get(importer)
        for line, module in imported_modules(path.read_text()):
            if not module.startswith("router."):
                continue
            imported = _room_of(module)
            if imported == importer:
                continue
            if allowed is None:  # a shared top-level module: it imports no room
                bad = imported in ROOM_IMPORTS or imported in COMPOSITION_ROOT
            else:
                bad = imported not in allowed and (
                    imported in ROOM_IMPORTS or imported in COMPOSITION_ROOT
                )
            if bad:
                found.append(f"{'/'.join(parts)}.py:{line}: {importer} imports {imported}")
    return found


def test_a_room_importing_against_the_direction_is_found(tmp_path: Path) -> None:
    for room in ("fleet", "upstream"):
        (tmp_path / "router" / room).mkdir(parents=True)
    (tmp_path / "router" / "upstream" / "x.py").write_text(
        "from router.fleet.health import HealthProber\nfrom router.errors import RouterError\n"
    )
    (tmp_path / "router" / "fleet" / "y.py").write_text("from router.upstream.base import X\n")
    (tmp_path / "router" / "errors.py").write_text("def f():\n    from router.app import app\n")
    assert room_violations(tmp_path) == [
        "router/errors.py:2: errors imports app",
        "router/upstream/x.py:1: upstream imports fleet",
    ]


def test_routers_rooms_import_one_way() -> None:
    assert room_violations(ROOT) == []


def test_every_room_says_its_job_and_what_it_may_import() -> None:
    for room in ROOM_IMPORTS:
        doc = ast.get_docstring(ast.parse((ROOT / "router" / room / "__init__.py").read_text()))
        assert doc, f"router/{room}/__init__.py has no docstring"
        assert "May import" in doc, f"router/{room}/__init__.py does not say what it may import"


# ------------------------------------------------------------------------------ import circles


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for package in PRODUCT:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the product modules it imports (``from package import module`` counts as the
    module; importing a submodule does not count its package's ``__init__``)."""
    names = _module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in names] or [node.module]
            graph[name].update(t for t in targets if t in names and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_the_product() -> None:
    assert circles(import_graph(ROOT)) == []
