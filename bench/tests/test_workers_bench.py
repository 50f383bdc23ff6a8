"""bench.load.workers: the placement and helper counts, the router's command, the serving
processes found in /proc, the load-generator group, the record and row arithmetic, the tables,
the command line; and short real runs (every process real) at N = 1."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bench.common.process import Child, children, free_port
from bench.common.stats import Percentiles
from bench.load import workers, workers_stack
from bench.load.loadgen import LoadResult
from bench.load.loadgen_group import GroupSpec as Spec
from bench.load.loadgen_group import Share, member_argv, split
from bench.load.worker_procs import pin, serving_processes, tree_cpu
from bench.load.workers_report import (
    Measured,
    Report,
    RunRecord,
    make_record,
    make_rows,
    render,
    render_markdown,
)
from bench.load.workers_stack import (
    Fake,
    Fakes,
    auto_fakes,
    auto_loadgens,
    placement,
    router_argv,
    router_env,
)

CPUS16 = list(range(16))

# --- placement, sizes, commands ----------------------------------------------------------------


def test_the_router_gets_the_first_n_cores_when_n_plus_4_fit() -> None:
    place = placement(8, CPUS16)
    assert place.pinned and place.router == tuple(range(8)) and place.helpers == tuple(range(8, 16))
    assert place.describe(8) == "router on cores 0-7, fakes + loadgens on 8-15"
    assert placement(12, CPUS16).pinned
    unpinned = placement(13, CPUS16)
    assert not unpinned.pinned and unpinned.helper_cpus == tuple(CPUS16)
    assert unpinned.describe(13) == "unpinned (16 cores < N + 4 = 17)"
    assert (
        placement(1, [3, 5, 6, 7, 9]).describe(1) == "router on cores 3, fakes + loadgens on 5-7,9"
    )


def test_automatic_helper_counts_grow_with_n_within_the_cores() -> None:
    assert auto_fakes(1, 2) == 1 and auto_loadgens(1, 2) == 1
    assert [auto_fakes(n, 16) for n in (1, 2, 4, 16)] == [2, 3, 5, 5]
    assert [auto_loadgens(n, 15) for n in (1, 2, 4, 8)] == [1, 1, 2, 3]


def test_router_argv_passes_workers_only_above_one() -> None:
    fakes = Fakes([Fake("prefill", None, 1001, 1002), Fake("decode", None, 1003)])  # type: ignore[arg-type]
    one = router_argv("sglang", fakes, 8000, 1, "-")
    assert one[1:] == [
        "-m", "router", "--engine", "sglang",
        "--prefill", "http://127.0.0.1:1001", "1002", "--decode", "http://127.0.0.1:1003",
        "--host", "127.0.0.1", "--port", "8000", "--policy", "round_robin",
        "--max-connections-per-source", "0", "--log-level", "warning",
    ]  # fmt: skip
    two = router_argv("sglang", fakes, 8000, 2, "shared")
    assert two[len(one) :] == ["--workers", "2", "--worker-sockets", "shared"]


def test_router_env_has_no_process_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDR_SERVER__WORKERS", "8")
    monkeypatch.setenv("PDR_SERVER__WORKER_SOCKETS", "shared")
    env = router_env()
    assert "PDR_SERVER__WORKERS" not in env and "PDR_SERVER__WORKER_SOCKETS" not in env
    assert env["PYTHONPATH"].startswith(str(Path(workers.__file__).parents[2]))


def test_socket_modes_rotate_and_n1_has_one() -> None:
    cfg = workers.Config()
    assert workers.modes(cfg, 1, 0) == ["-"]
    assert workers.modes(cfg, 2, 0) == ["reuseport", "shared"]
    assert workers.modes(cfg, 2, 1) == ["shared", "reuseport"]


def test_defaults_and_quick() -> None:
    cfg = workers.config_from_args([])
    big = len(os.sched_getaffinity(0)) >= 8
    assert cfg.workers == ((1, 2, 4, 8, 16) if big else (1, 2))
    assert (cfg.sockets, cfg.engine, cfg.repeats, cfg.duration) == (
        ("reuseport", "shared"), "vllm-mooncake", 3, 10.0
    )  # fmt: skip
    assert cfg.fake_procs is None and cfg.loadgen_procs is None and not cfg.stream
    quick = workers.config_from_args(["--quick", "--fake-procs", "3", "--sockets", "shared"])
    assert (quick.repeats, quick.duration, quick.fake_procs, quick.sockets) == (
        1,
        2.0,
        3,
        ("shared",),
    )


@pytest.mark.parametrize(
    "argv", ["--sockets both", "--fake-procs 0", "--workers-list 0,2", "--engine vllm-nixl"]
)
def test_bad_options_are_refused(argv: str) -> None:
    with pytest.raises(SystemExit):
        workers.config_from_args(argv.split())


# --- /proc -------------------------------------------------------------------------------------

SUPERVISOR = """
import socket, subprocess, sys, time
port, mode = int(sys.argv[1]), sys.argv[2]
REUSE = (
    "import socket, sys, time\\n"
    "s = socket.socket()\\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\\n"
    "s.bind(('127.0.0.1', int(sys.argv[1])))\\n"
    "s.listen()\\n"
    "time.sleep(60)\\n"
)
INHERIT = (
    "import socket, sys, time\\ns = socket.socket(fileno=int(sys.argv[1]))\\ntime.sleep(60)\\n"
)
if mode == "shared":
    sock = socket.create_server(("127.0.0.1", port))
    code, arg, fds = INHERIT, str(sock.fileno()), (sock.fileno(),)
else:
    code, arg, fds = REUSE, str(port), ()
kids = [subprocess.Popen([sys.executable, "-c", code, arg], pass_fds=fds) for _ in range(2)]
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["reuseport", "shared"])
def test_serving_processes_are_the_children_that_hold_the_listening_socket(mode: str) -> None:
    port = free_port()
    with Child([sys.executable, "-c", SUPERVISOR, str(port), mode], stop_grace_s=2.0) as parent:
        deadline = time.monotonic() + 20
        while len(found := serving_processes(parent.pid, port, supervised=True)) < 2:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        assert found == sorted(children(parent.pid))
        alone = serving_processes(parent.pid, port, supervised=False)
        assert alone == ([parent.pid] if mode == "shared" else [])
        cpu = tree_cpu(parent.pid, found)
        assert set(cpu.serving) == set(found) and cpu.tree >= cpu.root >= 0
        pin(found[0], {min(os.sched_getaffinity(0))})
        assert os.sched_getaffinity(found[0]) == {min(os.sched_getaffinity(0))}


# --- the load-generator group --------------------------------------------------------------------


def test_split_and_member_argv() -> None:
    assert split(10, 3) == [4, 3, 3] and split(2, 2) == [1, 1]
    with pytest.raises(ValueError):
        split(1, 2)
    spec = Spec(9000, 64, 1000, 5.0, 2, 16, False, 2)
    argv = member_argv(spec, 32, 500)
    assert argv[1:] == [
        "-m", "bench.load.loadgen_group", "--port", "9000", "-c", "32", "-n", "500", "-d", "5.0",
        "--warmup", "2", "--tokens", "16", "--timeout", "30.0", "--no-stream",
    ]  # fmt: skip


# --- arithmetic and tables ---------------------------------------------------------------------


def share(completed: int, start: float, wall: float, p50: float, p99: float) -> Share:
    load = LoadResult(
        concurrency=8,
        completed=completed,
        errors=0,
        wall_s=wall,
        rps=completed / wall,
        ttft_ms=Percentiles(p50, p50, p99),
        latency_ms=Percentiles(p50, p50, p99),
        events_per_request=16.0,
        statuses={"200": completed},
        error_samples=[],
        loadgen_cpu_s=0.1 * wall,
        watched_cpu_s={},
    )
    return Share(load, started=start, ended=start + wall)


def test_a_record_adds_up_the_group_and_charges_the_router_per_request() -> None:
    measured = Measured(
        shares=[share(3000, 100.0, 1.0, 2.0, 9.0), share(1000, 100.1, 0.9, 4.0, 7.0)],
        cpu_window_s=1.0,
        tree_s=0.9,
        root_s=0.004,
        serving_s=[0.5, 0.396],
        fakes_s=[0.3, 0.95],
        supervised=True,
    )
    rec = make_record(RunRecord(2, "reuseport", 0), measured)
    assert rec.ok and rec.completed == 4000 and rec.loadgens == 2
    assert rec.window_s == pytest.approx(1.0) and rec.rps == pytest.approx(4000)
    assert rec.start_skew_ms == pytest.approx(100)
    assert rec.p50_ms == pytest.approx(2.5) and rec.p99_ms == 9.0
    assert rec.router_us == pytest.approx(225) and rec.supervisor_us == pytest.approx(1.0)
    assert rec.process_us == pytest.approx([250, 198])  # per an even share: 2000 requests each
    assert rec.process_busy == pytest.approx([0.5, 0.396]) and rec.fakes_busy_max == 0.95
    assert rec.loadgen_busy_max == pytest.approx(0.1)
    alone = make_record(
        RunRecord(1, "-", 0), Measured(measured.shares, 1, 0.4, 0.4, [0.4], [], False)
    )
    assert alone.supervisor_us is None and alone.process_us == pytest.approx([100])


def test_errors_fail_a_run() -> None:
    good = share(10, 0.0, 1.0, 1.0, 1.0)
    load = msgspec.structs.replace(good.load, errors=2, error_samples=["HTTP 503: busy"])
    measured = Measured([Share(load, 0.0, 1.0)], 1.0, 0.1, 0.1, [0.1], [], False)
    rec = make_record(RunRecord(1, "-", 0), measured)
    assert not rec.ok and rec.failure == "2 request errors (10 completed): HTTP 503: busy"


def record(n: int, sockets: str, rps: float, sup: float | None, ok: bool = True) -> RunRecord:
    return RunRecord(
        n, sockets, 0, ok=ok, failure=None if ok else "boom", completed=int(rps), rps=rps,
        p50_ms=1.0, p99_ms=3.0, router_us=200.0, process_us=[100.0 * n] * n,
        process_busy=[0.9] * n, supervisor_us=sup, resolution_us=0.5, fakes_busy_max=0.95,
        loadgen_busy_max=0.2,
    )  # fmt: skip


def test_rows_take_medians_over_runs_that_counted_and_the_efficiency_against_n1() -> None:
    records = [
        record(1, "-", 1000, None),
        record(2, "reuseport", 1700, 0.0),
        record(2, "reuseport", 1900, 0.0),
        record(2, "reuseport", 1800, 0.0),
        record(2, "shared", 1500, 2.0),
        record(2, "shared", 900, 2.0, ok=False),
    ]
    one, reuse, shared = make_rows(records)
    assert (one.efficiency, one.supervisor_us, one.ceiling_rps) == (1.0, None, None)
    assert reuse.rps == 1800 and reuse.efficiency == pytest.approx(0.9) and reuse.runs == 3
    assert reuse.ceiling_rps is None  # 0 µs: below one tick per request
    assert shared.runs == 1 and shared.failed == 1 and shared.efficiency == pytest.approx(0.75)
    assert shared.ceiling_rps == pytest.approx(500_000) and shared.spread == 1.0
    report = Report(
        {}, {}, {"1": "unpinned", "2": "unpinned"}, [one, reuse, shared], records, ["x"]
    )
    text = render(report)
    assert "PASS  N=2 reuseport: efficiency 0.90" in text
    assert "FAIL  N=2 shared: efficiency 0.75" in text
    assert "none measurable (<0.50)" in text and "2.00 (ceiling 500,000 req/s)" in text
    assert "NOTE  N=2 shared: a fake or load generator was 95% busy" in text
    assert "FAILED RUNS:" in text
    table = render_markdown([one, reuse]).splitlines()
    assert table[0].startswith("| N | sockets | req/s | efficiency | CPU µs/req |")
    assert table[2] == "| 1 | - | 1000 | 1.00 | 200 | 100 (1.00x) | n/a | 1.00 | 3.00 |"
    assert table[3].startswith("| 2 | reuseport | 1800 | 0.90 | 200 | 200 (1.00x) | none")


# --- real runs -------------------------------------------------------------------------------


def test_one_quick_run_at_n1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fakes, the router and two load generators, every process real."""
    out = tmp_path / "workers.json"
    argv = (
        "--quick --workers-list 1 --fake-procs 1 --loadgen-procs 2 --concurrency 4 "
        # 400 requests: enough CPU time for the 10 ms clock ticks /proc counts in
        f"--requests 400 --duration 2 --json {out} --log-dir {tmp_path}"
    )
    assert workers.main(argv.split()) == 0
    report = json.loads(out.read_text())
    assert not report["failures"] and list(report["placements"]) == ["1"]
    (rec,) = report["records"]
    assert rec["ok"] and rec["loadgens"] == 2 and 0 < rec["completed"] <= 400
    assert rec["router_us"] > 0 and len(rec["process_us"]) == 1 and rec["supervisor_us"] is None
    assert 0 < rec["p50_ms"] <= rec["p99_ms"] and rec["fakes_us"] > 0
    (row,) = report["rows"]
    assert (row["n"], row["sockets"], row["runs"], row["efficiency"]) == (1, "-", 1, 1.0)
    assert "| N | sockets | req/s | efficiency |" in capsys.readouterr().out


def test_a_router_that_does_not_start_is_a_failed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def exits(*_args: object) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]

    monkeypatch.setattr(workers_stack, "router_argv", exits)
    out = tmp_path / "workers.json"
    argv = f"--quick --workers-list 1 --fake-procs 1 --json {out} --log-dir {tmp_path}"
    assert workers.main(argv.split()) == 1
    report = json.loads(out.read_text())
    (failure,) = report["failures"]
    assert failure.startswith("N=1 - repeat 0: ") and "exited with code 3" in failure
    assert report["rows"][0]["runs"] == 0 and report["rows"][0]["failed"] == 1


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_one_quick_run_at_n2_in_both_socket_modes(tmp_path: Path) -> None:
    """A supervisor and its two serving processes per mode, every process real."""
    out = tmp_path / "workers.json"
    argv = (
        "--quick --workers-list 2 --fake-procs 1 --loadgen-procs 1 --concurrency 4 "
        f"--requests 600 --duration 2 --json {out} --log-dir {tmp_path}"
    )
    assert workers.main(argv.split()) == 0
    report = json.loads(out.read_text())
    assert not report["failures"]
    assert [(r["n"], r["sockets"]) for r in report["records"]] == [(2, "reuseport"), (2, "shared")]
    for rec in report["records"]:
        assert rec["ok"] and len(rec["process_us"]) == 2 and len(rec["process_busy"]) == 2
        assert rec["supervisor_us"] is not None and rec["resolution_us"] > 0
        # the tree holds both processes (and the supervisor)
        assert rec["router_us"] >= sum(rec["process_us"]) / 2 * 0.999
    assert all(row["efficiency"] is None for row in report["rows"])  # no N = 1 to compare with
