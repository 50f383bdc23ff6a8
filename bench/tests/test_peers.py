"""bench.load.peers: the interleaved schedule, the builds and the command and environment each
router gets, the medians, ratios and ledger arithmetic, the command line; and one real run of
our router against itself as the compare build (a git archive of HEAD)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from bench.common.process import REPO_ROOT, BenchError, Child
from bench.load import peers
from bench.load.peer_report import (
    ALL_OFF,
    FLOW,
    FLOW_BASE,
    FLOW_KEYS,
    BuildInfo,
    build_stats,
    compare_rows,
    ledger_builds,
    ledger_rows,
    make_report,
    matrix_rows,
    summarize,
)
from bench.load.peer_stack import (
    DIRECT,
    OURS,
    PEERS_BIN,
    Build,
    Cell,
    EnginePorts,
    EngineStack,
    RunBudget,
    RunRecord,
    feature_env,
    known_features,
    measure_run,
    router_argv,
    router_env,
    target_loadgen_argv,
)
from bench.load.peer_tables import render, render_ledger, worst_ratio_line
from bench.load.peers import (
    PeersConfig,
    Slot,
    compare_source,
    config_from_args,
    exit_code,
    plan_builds,
    schedule,
    targets_for,
)

S16_32 = Cell(16, 32, True)
N16_32 = Cell(16, 32, False)
PORTS = EnginePorts(prefill=1001, bootstrap=1002, decode=1003)


def record(
    target: str,
    cpu_us: float | None,
    p50_ms: float = 1.0,
    *,
    cell: Cell = S16_32,
    repeat: int = 0,
    engine: str = "vllm-mooncake",
    ok: bool = True,
) -> RunRecord:
    return RunRecord(
        engine,
        target,
        repeat,
        cell.tokens,
        cell.concurrency,
        cell.stream,
        ok=ok,
        failure=None if ok else "boom",
        router_cpu_us=cpu_us,
        latency_p50_ms=p50_ms,
    )


# --- the schedule ------------------------------------------------------------------------------


def test_each_repeat_runs_each_cell_once_on_every_target_and_rotates_who_goes_first() -> None:
    cells = [S16_32, N16_32]
    slots = schedule(cells, lambda _cell: ["direct", "ours", "peer"], repeats=3)
    assert len(slots) == 3 * 2 * 3
    for repeat in range(3):
        for cell in cells:
            run = [s.target for s in slots if s.repeat == repeat and s.cell == cell]
            assert sorted(run) == ["direct", "ours", "peer"]
    firsts = [s.target for s in slots[::3]]  # who goes first in each (repeat, cell) block
    assert firsts == ["direct", "ours", "ours", "peer", "peer", "direct"]
    # back to back: a cell's runs of one repeat are adjacent, so drift hits them alike
    assert slots[:3] == [Slot(0, S16_32, t) for t in ("direct", "ours", "peer")]


def test_two_routers_alternate_abab() -> None:
    slots = schedule([S16_32], lambda _cell: ["ours", "peer"], repeats=4)
    assert [s.target for s in slots] == ["ours", "peer", "peer", "ours"] * 2


def test_ledger_builds_run_in_the_ledger_cells_only() -> None:
    cfg = PeersConfig(ledger=True, compare_commit="HEAD")
    builds = plan_builds(cfg, "sglang", "/old", features=("FOO",))
    assert [b.name for b in builds] == ["ours", "peer", "old", "ours-no-foo", "ours-all-off"]
    assert targets_for(S16_32, builds, [S16_32]) == [DIRECT, *(b.name for b in builds)]
    assert targets_for(Cell(256, 1, True), builds, [S16_32]) == [DIRECT, "ours", "peer", "old"]


def test_the_cells_are_the_matrix_then_the_ledger_cells_it_lacks() -> None:
    cfg = PeersConfig(tokens=(256,), concurrency=(1,), modes=(True,))
    assert cfg.cells == (Cell(256, 1, True),)
    with_ledger = PeersConfig(tokens=(16,), concurrency=(32,), modes=(True,), ledger=True)
    assert with_ledger.cells == (S16_32, N16_32)


# --- the builds: commands and environments ----------------------------------------------------


def test_plan_builds() -> None:
    ours_only = plan_builds(PeersConfig(peers=False), "vllm-mooncake", None)
    assert ours_only == [Build("ours")]
    builds = plan_builds(PeersConfig(compare_python="/venv/bin/python"), "vllm-mooncake", None)
    assert [(b.name, b.kind, b.role) for b in builds] == [
        ("ours", "ours", "ours"),
        ("peer", "vllm-router", "peer"),
        ("old", "ours", "compare"),
    ]
    assert builds[2].python == "/venv/bin/python" and builds[2].source == ""
    sglang = plan_builds(PeersConfig(ledger=True), "sglang", None, features=("A_B", "C"))
    assert sglang[1].kind == "sglang-router"
    assert [(b.name, b.features_off) for b in sglang[2:]] == [
        ("ours-no-a-b", ("A_B",)),
        ("ours-no-c", ("C",)),
        ("ours-all-off", ("A_B", "C")),
    ]


def test_vllm_router_argv() -> None:
    argv = router_argv(Build("peer", kind="vllm-router"), "vllm-mooncake", PORTS, 2000, 2001)
    assert argv[0] == str(PEERS_BIN / "vllm-router")
    text = " ".join(argv)
    assert "--vllm-pd-disaggregation" in argv
    assert "--prefill http://127.0.0.1:1001 1002 --decode http://127.0.0.1:1003" in text
    assert "--kv-connector mooncake" in text and "--policy round_robin" in text
    assert "--port 2000" in text and "--prometheus-port 2001" in text
    assert "--host 127.0.0.1" in text and "--prometheus-host 127.0.0.1" in text


def test_sglang_router_argv() -> None:
    argv = router_argv(Build("peer", kind="sglang-router"), "sglang", PORTS, 2000, 2001)
    assert argv[:4] == [
        str(PEERS_BIN / "python"),
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
    ]
    text = " ".join(argv)
    assert "--prefill http://127.0.0.1:1001 1002 --decode http://127.0.0.1:1003" in text
    assert "--policy round_robin" in text and "--port 2000" in text
    assert "--prometheus-port 2001" in text


def test_our_router_argv_does_not_import_from_the_working_directory() -> None:
    argv = router_argv(Build("old", python="/venv/bin/python"), "sglang", PORTS, 2000, 2001)
    assert argv[:4] == ["/venv/bin/python", "-P", "-m", "router"]
    text = " ".join(argv)
    assert "--engine sglang" in text and "--policy round_robin" in text
    assert "--prefill http://127.0.0.1:1001 1002 --decode http://127.0.0.1:1003" in text


def test_environments() -> None:
    base = {"PYTHONPATH": "/elsewhere", "KEEP": "1"}
    ours = router_env(Build("ours"), base)
    assert ours["PYTHONPATH"] == str(REPO_ROOT) and ours["KEEP"] == "1"
    assert not any(k.startswith("PDR_FEATURES__") for k in ours)
    off = router_env(Build("x", features_off=("NOT_A_REAL_FEATURE",)), base)
    assert off["PDR_FEATURES__NOT_A_REAL_FEATURE"] == "false"
    old = router_env(Build("old", source="/old/tree"), base)
    assert old["PYTHONPATH"] == "/old/tree"
    installed = router_env(Build("old", source=""), base)
    assert "PYTHONPATH" not in installed
    peer = router_env(Build("peer", kind="vllm-router", features_off=("X",)), base)
    assert "PYTHONPATH" not in peer and "PDR_FEATURES__X" not in peer
    assert feature_env(("A", "B")) == {"PDR_FEATURES__A": "false", "PDR_FEATURES__B": "false"}


class _Switches(BaseModel):
    metrics: bool = True
    trace_headers: bool = True


class _WithFeatures(BaseModel):
    features: _Switches = _Switches()


class _WithoutFeatures(BaseModel):
    port: int = 0


def test_known_features_are_the_fields_of_the_features_group() -> None:
    assert known_features(_WithFeatures) == {"METRICS", "TRACE_HEADERS"}
    assert known_features(_WithoutFeatures) == frozenset()


# --- arithmetic ----------------------------------------------------------------------------


def test_medians_leave_failed_runs_out() -> None:
    runs = [
        record("ours", 500),
        record("ours", 300),
        record("ours", 900),
        record("ours", 1, ok=False),
    ]
    stats = build_stats(runs)
    assert (stats.runs, stats.ok) == (4, 3)
    assert (stats.cpu_us, stats.cpu_us_min, stats.cpu_us_max) == (500, 300, 900)
    none = build_stats([record("ours", 1, ok=False)])
    assert none.cpu_us is None and none.p50_ms is None


def test_matrix_ratio_and_added_latency() -> None:
    records = [
        *(record(DIRECT, None, p50_ms=p) for p in (1.0, 2.0, 3.0)),
        *(record("ours", us, p50_ms=p) for us, p in ((400, 2.5), (380, 2.6), (420, 2.4))),
        *(record("peer", us, p50_ms=4.0) for us in (500, 390, 450)),
        record("ours", 900, cell=N16_32),
        record("peer", 450, cell=N16_32),
    ]
    rows = matrix_rows(summarize(records), "ours", "peer")
    assert [row.cell for row in rows] == ["16 tok C=32 stream", "16 tok C=32 non-stream"]
    assert rows[0].ratio == pytest.approx(400 / 450) and rows[0].passed is True
    assert rows[0].ours_added_p50_ms == pytest.approx(0.5)
    assert rows[0].peer_added_p50_ms == pytest.approx(2.0)
    assert rows[1].ratio == pytest.approx(2.0) and rows[1].passed is False
    assert rows[1].ours_added_p50_ms is None  # no direct run in that cell
    line = worst_ratio_line(rows)
    assert line.startswith("worst ratio: 2.00 (vllm-mooncake, 16 tok C=32 non-stream)")
    assert line.endswith("1/2 cells <= 1: FAIL")
    assert worst_ratio_line(rows[:1]).endswith("1/1 cells <= 1: PASS")


def test_a_cell_without_a_peer_run_that_counted_fails() -> None:
    records = [record("ours", 400), record("peer", 300, ok=False)]
    rows = matrix_rows(summarize(records), "ours", "peer")
    assert rows[0].ratio is None and rows[0].passed is None
    assert worst_ratio_line(rows).endswith("FAIL")


def test_compare_ratio_is_new_over_old() -> None:
    records = [record("ours", 600), record("old", 800), record("ours", 610, repeat=1)]
    records.append(record("old", 790, repeat=1))
    (row,) = compare_rows(summarize(records), "ours", "old")
    assert row.new_us == pytest.approx(605) and row.old_us == pytest.approx(795)
    assert row.ratio == pytest.approx(605 / 795)


def test_ledger_costs_are_all_on_minus_one_off() -> None:
    records = [record("ours", us, repeat=i) for i, us in enumerate((700, 720, 710))]
    records += [record("ours-no-foo", us, repeat=i) for i, us in enumerate((650, 640, 660))]
    records += [record("ours-all-off", 400), record("ours", 1000, cell=N16_32)]
    infos = [
        BuildInfo("ours", "ours", "ours", [], ""),
        BuildInfo("ours-no-foo", "ours", "ledger", ["FOO"], ""),
        BuildInfo("ours-all-off", "ours", "ledger", ["FOO", "BAR"], ""),
    ]
    pairs = ledger_builds(infos)
    assert pairs == [("FOO", "ours-no-foo"), (ALL_OFF, "ours-all-off")]
    foo, everything = ledger_rows(summarize(records), "ours", pairs, unknown=frozenset({"BAR"}))
    assert foo.cost_us == {"vllm-mooncake 16 tok C=32 stream": pytest.approx(710 - 650)}
    assert foo.known and not everything.known  # BAR is unknown, so all-off is not all off
    assert everything.cost_us == {"vllm-mooncake 16 tok C=32 stream": pytest.approx(310)}
    table = render_ledger([foo, everything])
    assert "| FOO | +60 |" in table
    assert "| everything off (not a setting: measures nothing) | +310 |" in table
    assert table[-1] == "| sum of the single rows | +60 |"


def test_report_render_and_exit_code() -> None:
    records = [record(DIRECT, None), record("ours", 300, p50_ms=1.5), record("peer", 400)]
    infos = [
        BuildInfo("ours", "ours", "ours", [], "/x"),
        BuildInfo("peer", "vllm-router", "peer", [], ""),
    ]
    report = make_report({"repeats": 1}, {"commit": "abc"}, infos, records)
    text = render(report)
    assert "| engine | cell | ours µs | peer µs | ratio | ours +p50 ms | peer +p50 ms |" in text
    assert (
        "| vllm-mooncake | 16 tok C=32 stream | 300 | 400 | 0.75 | +0.50 | +0.00 | PASS |" in text
    )
    assert "worst ratio: 0.75" in text and "FAILED" not in text
    assert exit_code(report, check=True) == 0
    failed = make_report({}, {}, infos, [*records, record("peer", 1, ok=False, repeat=1)])
    assert exit_code(failed, check=False) == 1
    assert "FAILED RUNS (1)" in render(failed) and "#2 peer: boom" in render(failed)
    slower = make_report({}, {}, infos, [record("ours", 500), record("peer", 400)])
    assert exit_code(slower, check=False) == 0 and exit_code(slower, check=True) == 3


# --- the command line --------------------------------------------------------------------------


def test_defaults_and_quick() -> None:
    cfg = config_from_args([])
    assert cfg.engines == ("vllm-mooncake", "sglang") and cfg.tokens == (16, 256)
    assert cfg.concurrency == (1, 32, 128) and cfg.modes == (True, False)
    assert (cfg.requests, cfg.repeats, cfg.peers, cfg.ledger) == (2000, 3, True, False)
    assert len(cfg.cells) == 12
    quick = config_from_args(["--quick"])
    assert quick.repeats == 1 and quick.requests < cfg.requests and quick.duration < cfg.duration


def test_options() -> None:
    argv = (
        "--engines sglang --tokens 16 --concurrency 32 --modes non-stream --requests 50 "
        "--repeats 5 --no-peers --ledger --ledger-cells 16:1:stream,256:32:non-stream "
        "--compare-commit e284869 --compare-python /v/bin/python"
    )
    cfg = config_from_args(argv.split())
    assert cfg.engines == ("sglang",) and cfg.modes == (False,) and cfg.requests == 50
    assert cfg.repeats == 5 and not cfg.peers and cfg.compares
    assert cfg.ledger_cells == (Cell(16, 1, True), Cell(256, 32, False))
    assert cfg.cells == (Cell(16, 32, False), Cell(16, 1, True), Cell(256, 32, False))


@pytest.mark.parametrize(
    "argv",
    [
        "--engines vllm-nixl",
        "--modes streaming",
        "--ledger-cells 16:32",
        "--ledger-cells 16:0:stream",
        "--repeats 0",
        "--duration -1",
        "--warmup -1",
        "--compare-commit HEAD --compare-pythonpath /tmp",
    ],
)
def test_bad_options_are_refused(argv: str) -> None:
    with pytest.raises(SystemExit):
        config_from_args(argv.split())


def test_compare_commit_is_archived_and_removed(tmp_path: Path) -> None:
    with compare_source(PeersConfig(compare_commit="HEAD")) as source:
        assert source is not None
        assert (Path(source) / "router" / "__init__.py").is_file()
    assert not Path(source).exists()
    with compare_source(PeersConfig(compare_pythonpath=str(tmp_path))) as given:
        assert given == str(tmp_path)


def test_a_bad_commit_is_a_clear_error() -> None:
    with (
        pytest.raises(BenchError, match="git archive"),
        compare_source(PeersConfig(compare_commit="no-such-revision-xyz")),
    ):
        pass


def test_the_flow_base_build_loads_at_the_concurrency_the_flow_build_admits(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.yaml"
    planned = plan_builds(PeersConfig(flow_control=True), "sglang", None, (), keys)
    builds = {b.name: b for b in planned}
    assert {FLOW, FLOW_KEYS, FLOW_BASE} <= set(builds)
    assert builds[FLOW_BASE].env == () and builds[FLOW_BASE].headers == ()
    queue = dict(builds[FLOW].env)["PDR_ADMISSION__MAX_CONCURRENT_REQUESTS"]
    assert builds[FLOW_BASE].callers == int(queue) < S16_32.concurrency
    budget = RunBudget(requests=10, duration=1.0, warmup=0)
    with Child(["sleep", "30"], name="router") as router:
        routers = {name: (router, 7) for name in (OURS, FLOW_BASE)}
        stack = EngineStack("sglang", PORTS, router, router, {}, routers)
        stack.callers[FLOW_BASE] = int(queue)

        def callers(target: str) -> str:
            argv = target_loadgen_argv(stack, target, S16_32, budget)
            return argv[argv.index("-c") + 1]

        assert (callers(OURS), callers(FLOW_BASE)) == ("32", queue)


# --- failed runs -------------------------------------------------------------------------------


def _stack(router: Child, prefill: Child, decode: Child) -> EngineStack:
    return EngineStack("sglang", PORTS, prefill, decode, {}, {"ours": (router, 1)})


def test_a_router_that_died_is_a_failed_run_and_a_dead_fake_stops_the_bench() -> None:
    budget = RunBudget(requests=10, duration=1.0, warmup=0)
    with (
        Child([sys.executable, "-c", "pass"], name="router") as router,
        Child(["sleep", "30"], name="prefill") as prefill,
        Child(["sleep", "30"], name="decode") as decode,
    ):
        router.popen.wait(10)
        result = measure_run(_stack(router, prefill, decode), "ours", S16_32, 0, budget)
        assert not result.ok and result.failure == "not run: ours exited earlier"
        assert result.router_cpu_us is None
        decode.stop(grace_s=1.0)
        with pytest.raises(BenchError, match="exited with code"):
            measure_run(_stack(router, prefill, decode), DIRECT, S16_32, 0, budget)


# --- one real run ------------------------------------------------------------------------------


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_our_router_against_itself_as_the_compare_build(tmp_path: Path) -> None:
    """Fakes, our router and HEAD's router as the compare build, every process real."""
    out = tmp_path / "peers.json"
    argv = (
        "--quick --no-peers --engines sglang --tokens 4 --concurrency 2 --modes stream "
        # 300 requests: enough CPU time for the 10 ms clock ticks /proc counts in (20 could read 0)
        f"--requests 300 --warmup 1 --compare-commit HEAD --json {out} --log-dir {tmp_path}"
    )
    assert peers.main(argv.split()) == 0
    report = json.loads(out.read_text())
    assert not report["failures"]
    assert [r["target"] for r in report["records"]] == ["direct", "ours", "old"]
    assert all(r["ok"] and r["load"]["completed"] >= 300 for r in report["records"])
    builds = {b["name"]: b["router"] for b in report["builds"]}
    assert builds["ours"] == str(REPO_ROOT / "router" / "__init__.py")
    assert "pd-peers-old-" in builds["old"] and builds["old"].endswith("/router/__init__.py")
    (row,) = report["compare"]
    assert row["ratio"] is not None and row["new_us"] > 0 and row["old_us"] > 0
