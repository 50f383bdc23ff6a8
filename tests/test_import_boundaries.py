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
