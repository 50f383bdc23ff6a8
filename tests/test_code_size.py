"""The product stays in small pieces: no module over 400 lines, no class over 250, no function
over 60 (measured on the syntax tree, decorators excluded, docstrings and comments included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("router", "registry", "transfer", "worker")
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 400, 250, 60


def oversized(root: Path) -> list[str]:
    """``path[:name] lines`` for every module, class and function over its limit."""
    found = []
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text()
            where = path.relative_to(root).as_posix()
            if (lines := len(source.splitlines())) > MAX_MODULE:
                found.append(f"{where} {lines}")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef):
                    limit = MAX_CLASS
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    limit = MAX_FUNCTION
                else:
                    continue
                end = node.end_lineno or node.lineno
                if (lines := end - node.lineno + 1) > limit:
                    found.append(f"{where}:{node.name} {lines}")
    return found


def test_an_oversized_function_is_found(tmp_path: Path) -> None:
    (tmp_path / "router").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION))
    (tmp_path / "router" / "big.py").write_text(f"def f():\n{body}")
    assert oversized(tmp_path) == [f"router/big.py:f {MAX_FUNCTION + 1}"]


def test_the_product_is_in_small_pieces() -> None:
    assert oversized(ROOT) == []
