"""``bench.load.pipeline_cost``: the router's request path measured in process, build against
build, with its upstream legs answered from memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.common.process import REPO_ROOT, BenchError
from bench.load import pipeline_cost
from bench.load.peer_stack import FEATURES
from bench.load.pipeline_cost import (
    CostBuild,
    CostConfig,
    CostReport,
    CostRow,
    plan_builds,
    render,
    run_child,
)


def test_builds_ours_the_compare_tree_and_the_ledger() -> None:
    assert [b.name for b in plan_builds(CostConfig(), None)] == ["ours"]
    builds = plan_builds(CostConfig(ledger=True), "/old/tree")
    assert (builds[1].name, builds[1].source) == ("old", "/old/tree")
    assert [b.features_off for b in builds[2:-1]] == [(f,) for f in FEATURES]
    assert builds[-1].features_off == FEATURES
    assert all(b.source == str(REPO_ROOT) for b in builds if b.name != "old")


def test_render_prints_the_ratio_and_the_ledger() -> None:
    def row(build: str, us: float) -> CostRow:
        return CostRow("sglang", "non-stream", build, [us], us)

    report = CostReport({}, {}, [row("ours", 60), row("old", 80), row("no-metrics", 55)])
    text = render(report)
    assert "| sglang | non-stream | 60.0 | 80.0 | 0.75 |" in text
    assert text.splitlines()[-1].split() == ["no-metrics", "+5.0"]


@pytest.mark.parametrize("argv", ["--engines vllm-nixl", "--modes both", "--requests 0"])
def test_bad_options_are_refused(argv: str) -> None:
    with pytest.raises(SystemExit):
        pipeline_cost.config_from_args(argv.split())


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_this_checkout_against_itself_measures_every_request_answered(tmp_path: Path) -> None:
    """Fakes, and two children (this checkout, and HEAD archived as the compare build), each
    serving both modes; a child whose requests were not all answered 200 fails the bench."""
    out = tmp_path / "cost.json"
    argv = (
        "--engines sglang --repeats 1 --requests 300 --batches 1 --concurrency 4 "
        f"--compare-commit HEAD --json {out}"
    )
    assert pipeline_cost.main(argv.split()) == 0
    report = json.loads(out.read_text())
    cells = {(row["mode"], row["build"]): row["us"] for row in report["rows"]}
    assert set(cells) == {(m, b) for m in ("non-stream", "stream") for b in ("ours", "old")}
    assert all(us > 0 for us in cells.values())
    assert report["builds"]["ours"] == str(REPO_ROOT / "router" / "__init__.py")
    assert "pd-peers-old-" in report["builds"]["old"]


def test_a_child_with_answers_other_than_200_fails_the_bench() -> None:
    said = '{"us": [50.0], "statuses": {"200": 9, "503": 1}, "router": "x"}'
    child = [sys.executable, "-c", f"print({said!r})"]
    with pytest.raises(BenchError, match="answers other than 200"):
        run_child(child, CostBuild("ours", str(REPO_ROOT)))
    fine = said.replace(', "503": 1', "")
    assert run_child([sys.executable, "-c", f"print({fine!r})"], CostBuild("ours", ""))["us"] == [
        50.0
    ]
