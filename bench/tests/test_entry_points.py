"""``python -m bench`` lists every runnable benchmark, each by a command that exists."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from bench.__main__ import BENCHMARKS, SUITES, Benchmark, main, render

BENCH = Path(__file__).resolve().parents[1]


def _runnable() -> set[str]:
    """``SUITE.MODULE`` for every suite module run as a script; ``SUITE`` for a suite's main."""
    names = set()
    for path in BENCH.glob("*/*.py"):
        suite = path.parent.name
        if suite in ("common", "tests") or 'if __name__ == "__main__":' not in path.read_text():
            continue
        if path.name == "__main__.py":
            names.add(suite)
        elif not (path.stem == "main" and (path.parent / "__main__.py").exists()):
            names.add(f"{suite}.{path.stem}")
    return names


def test_every_runnable_benchmark_is_listed_once() -> None:
    names = [b.name for b in BENCHMARKS]
    assert len(names) == len(set(names))
    assert set(names) == _runnable()
    assert {b.suite for b in BENCHMARKS} == set(SUITES)


@pytest.mark.parametrize("benchmark", BENCHMARKS, ids=lambda b: b.name)
def test_each_command_names_a_module_that_exists(benchmark: Benchmark) -> None:
    module = benchmark.command.removeprefix("python -m ")
    assert importlib.util.find_spec(module) is not None


def test_every_suite_says_what_it_measures_in_one_line() -> None:
    for suite in (*SUITES, "common"):
        tree = ast.parse((BENCH / suite / "__init__.py").read_text())
        doc = ast.get_docstring(tree)
        assert doc and "\n" not in doc and doc != "TODO.", suite


def test_the_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.strip() == render()
    for benchmark in BENCHMARKS:
        assert benchmark.command in out and benchmark.what in out
    assert main(["--bogus"]) == 2
