"""bench.routing.tokenize_cost: a small run prints every row and the verdict; a completions
prompt whose prefix was seen is served mostly from the piece cache, and not with --no-cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.routing.tokenize_cost import main

SMALL = ["--requests", "6", "--groups", "2", "--prompt-tokens", "400", "--seen-tokens", "300"]


def _rows(path: Path) -> dict[str, dict[str, float]]:
    return {row["name"]: row for row in json.loads(path.read_text())["rows"]}


def test_small_run_prints_every_row_and_the_verdict(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([*SMALL, "--json", str(tmp_path / "on.json")]) == 0
    out = capsys.readouterr().out
    for label in ("completions, prefix seen", "completions, cold", "chat, prefix seen"):
        assert label in out
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 1 and "tokenize p50 <= 1 ms" in verdicts[0]
    rows = _rows(tmp_path / "on.json")
    assert rows["completions, prefix seen"]["hit_ratio"] > 0.5
    assert rows["completions, cold"]["hit_ratio"] == 0
    assert 350 < rows["completions, prefix seen"]["prompt_tokens"] < 450


def test_no_cache_cuts_at_added_tokens_only(tmp_path: Path) -> None:
    assert main([*SMALL, "--no-cache", "--json", str(tmp_path / "off.json")]) == 0
    rows = _rows(tmp_path / "off.json")
    assert rows["completions, prefix seen"]["hit_ratio"] == 0
    assert rows["chat, prefix seen"]["hit_ratio"] > 0  # the template's added tokens still cut
