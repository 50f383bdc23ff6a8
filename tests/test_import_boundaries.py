"""The import direction between the top-level packages, checked on every module's syntax tree.

registry and transfer are the ground floor, router and worker stand on them; test support
(``testkit``) serves ``tests`` and ``bench`` and nothing in the product imports it; no test
imports a benchmark (the benchmarks' own tests live in ``bench/tests``), and nothing outside
``tests`` imports ``tests``. Function-level imports count too.
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


def imported_packages(source: str) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every absolute import in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def violations(root: Path, package: str) -> list[str]:
    """``path:line imports X`` for every forbidden import under ``root/package``."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        banned = FORBIDDEN[package]
        for line, imported in imported_packages(path.read_text()):
            if imported in banned:
                found.append(f"{path.relative_to(root)}:{line} imports {imported}")
    return found


def test_a_forbidden_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "x.py").write_text(
        "def f():\n    from testkit.polling import wait_until\n"
    )
    assert violations(tmp_path, "router") == ["router/x.py:2 imports testkit"]


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layering(package: str) -> None:
    assert violations(ROOT, package) == []
