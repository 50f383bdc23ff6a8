"""bench.discovery.registry: the quick run completes and prints every section."""

from __future__ import annotations

import pytest

from bench.discovery.registry import main


def test_quick_run_prints_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--n", "100", "--watch-n", "20", "--lookups", "5000"]) == 0
    out = capsys.readouterr().out
    for heading in ("1. Per-request", "2. Watch propagation", "3a. Registration", "3b. vLLM"):
        assert heading in out
    http_rows = [line for line in out.splitlines() if "POST /register over HTTP" in line]
    assert len(http_rows) == 2
    assert all(row.endswith(" 100 stored") for row in http_rows)  # every registration landed
