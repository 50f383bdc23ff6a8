"""bench.routing.kv_index: a small run completes and reports every figure with a verdict."""

from __future__ import annotations

import pytest

from bench.routing.kv_index import main


def test_small_run_prints_every_figure_and_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--blocks", "3000", "--locations", "3", "--prompts", "30"]) == 0
    out = capsys.readouterr().out
    for label in (
        "blocks indexed            2,944",
        "bytes per block",
        "apply_stored ",
        "chain_keys per prompt",
        "match, hit",
        "(128 blocks matched)",
        "match, miss",
        "chain_keys + match, hit",
        "apply_stored past the cap",
    ):
        assert label in out
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 3
