"""``bench.load.flow_control`` and ``pipeline_cost --flow-control``: the pure parts (the open-loop
schedule's bounds, the options, the keys files, the figures and their verdicts)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from bench.common.stats import Percentiles
from bench.load import flow_control, pipeline_cost
from bench.load.flow_control import KEYS, FlowConfig, keys_file_text, parse_args, router_flags
from bench.load.flow_load import MAX_REQUESTS_PER_STREAM, Outcome, fire_times, run_phase
from bench.load.flow_report import (
    FlowReport,
    StreamSummary,
    fairness_verdict,
    priority_verdict,
    render,
    starvation_verdict,
    summarize,
    throughput,
    windows,
)
from bench.load.peer_stack import flow_keys_text
from bench.load.pipeline_cost import (
    FLOW,
    CostConfig,
    CostReport,
    CostRow,
    flow_keys,
    plan_builds,
)
from router.tenancy.client_keys import load_key_table

# --- the open-loop schedule --------------------------------------------------------------------


def test_fire_times_are_one_per_period_within_the_duration() -> None:
    assert fire_times(4.0, 1.0) == [0.0, 0.25, 0.5, 0.75]
    assert fire_times(3.0, 1.0) == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert len(fire_times(7.37, 60.0)) == math.ceil(7.37 * 60.0)
    assert max(fire_times(7.37, 60.0)) < 60.0


def test_fire_times_are_bounded_in_count() -> None:
    assert len(fire_times(1e9, 1e9)) == MAX_REQUESTS_PER_STREAM
    assert len(fire_times(100.0, 10.0, cap=5)) == 5
    assert fire_times(100.0, 10.0, cap=-1) == []


@pytest.mark.parametrize(
    ("rate", "duration"), [(0.0, 10.0), (-1.0, 10.0), (5.0, 0.0), (math.inf, 1.0), (math.nan, 1.0)]
)
def test_fire_times_of_no_rate_or_no_time_are_none(rate: float, duration: float) -> None:
    assert fire_times(rate, duration) == []


def test_only_loopback_is_loaded() -> None:
    with pytest.raises(ValueError, match="only 127.0.0.1"):
        run_phase(
            "http://10.0.0.1:8000", "m", [], duration_s=1, drain_s=1, prompt_tokens=1, max_tokens=1
        )


# --- options and keys --------------------------------------------------------------------------


def test_options_become_the_config() -> None:
    argv = "--duration 30 --alone 5 --priority-aging 0 --flood 4 --max-concurrent 8 --json out.json"
    cfg = parse_args([*argv.split(), "--", "--decode-s-per-token", "0.5"])
    assert (cfg.duration_s, cfg.alone_s, cfg.priority_aging_s) == (30.0, 5.0, 0.0)
    assert (cfg.flood, cfg.max_concurrent, cfg.json_out) == (4.0, 8, Path("out.json"))
    assert cfg.worker_args == ("--decode-s-per-token", "0.5")
    assert (
        cfg.prefill_cap,
        parse_args(["--prefill-cap", "0", "--max-concurrent", "8"]).prefill_cap,
    ) == (1, 0)
    assert parse_args([]).worker_args == FlowConfig().worker_args
    assert (parse_args([]).reserve, parse_args(["--reserve", "1"]).reserve) == (0, 1)


@pytest.mark.parametrize(
    "argv",
    [
        *("--duration 0", "--flood -1", "--max-concurrent -1", "--priority-aging -1"),
        "--max-concurrent 0 --prefill-cap 0",
        *("--warmup 60", "--prefill-cap -1", "--reserve -1"),
        "--reserve 1 --prefill-cap 0 --max-concurrent 8",
    ],
)
def test_bad_options_are_refused(argv: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv.split())


def test_the_keys_files_load_as_the_router_loads_them(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_file_text())
    table = load_key_table(path)
    assert {table.tenant_for(key) for key in KEYS.values()} == set(KEYS)
    assert all(spec.weight == 1.0 for spec in table.specs.values())
    path.write_text(flow_keys_text(flow_keys(3)))
    table = load_key_table(path)
    assert [table.tenant_for(key) for key in flow_keys(3)] == ["tenant-0", "tenant-1", "tenant-2"]
    assert all(spec.requests_per_minute and spec.max_concurrent for spec in table.specs.values())


def test_the_router_gets_keys_slots_timeout_and_aging() -> None:
    cfg = FlowConfig(max_concurrent=12, queue_timeout_s=7.5, priority_aging_s=0.0, prefill_cap=0)
    flags = router_flags(cfg, Path("/k.yaml"))
    assert all(flag.startswith("--router-arg=") for flag in flags)
    values = [flag.removeprefix("--router-arg=") for flag in flags]
    pairs = dict(zip(values[::2], values[1::2], strict=True))
    assert pairs == {
        "--api-keys": "/k.yaml",
        "--max-concurrent-requests": "12",
        "--queue-timeout": "7.5",
        "--priority-aging": "0",
    }
    capped = router_flags(replace(cfg, prefill_cap=2, reserve=1), Path("/k.yaml"))
    assert capped[len(flags) :] == [
        "--router-arg=--max-inflight-per-prefill",
        "--router-arg=2",
        "--router-arg=--queue-at-worker-caps",
        "--router-arg=--worker-queue-reserve",
        "--router-arg=1",
    ]


def test_flow_control_builds_use_keys_and_queue(tmp_path: Path) -> None:
    cfg = CostConfig(flow_control=True, concurrency=32)
    builds = {b.name: b for b in plan_builds(cfg, None, tmp_path / "k.yaml")}
    assert set(builds) == {"ours", FLOW, "flow-keys", "flow-queue"}
    env = dict(builds[FLOW].env)
    assert env["PDR_AUTH__API_KEYS"] == str(tmp_path / "k.yaml")
    assert env["PDR_ADMISSION__MAX_CONCURRENT_REQUESTS"] == "16"  # half the callers wait
    assert builds[FLOW].caller_args == ("--keys", ",".join(flow_keys()))
    assert "PDR_AUTH__API_KEYS" not in dict(builds["flow-queue"].env)
    assert not builds["ours"].env and not builds["ours"].caller_args
    assert [b.name for b in plan_builds(CostConfig(), None, tmp_path / "k.yaml")] == ["ours"]
    compared = {b.name: b for b in plan_builds(cfg, "/old/tree", tmp_path / "k.yaml")}
    assert set(compared) == {*builds, "old", "flow-keys-old"}
    assert compared["flow-keys-old"].source == "/old/tree"
    assert compared["flow-keys-old"].env == builds["flow-keys"].env
    assert compared["flow-keys-old"].caller_args == builds["flow-keys"].caller_args
    assert pipeline_cost.config_from_args(["--flow-control"]).flow_control


def test_the_cost_ratio_and_its_verdict_are_rendered() -> None:
    def row(build: str, us: float) -> CostRow:
        return CostRow("sglang", "stream", build, [us], us)

    text = pipeline_cost.render(CostReport({}, {}, [row("ours", 100.0), row(FLOW, 109.0)]))
    assert "| sglang | stream | 100.0 | 109.0 | 1.090 | pass |" in text
    text = pipeline_cost.render(CostReport({}, {}, [row("ours", 100.0), row(FLOW, 111.0)]))
    assert "| sglang | stream | 100.0 | 111.0 | 1.110 | FAIL |" in text


# --- figures -----------------------------------------------------------------------------------


def _ok(label: str, sent: float, ttft: float, done: float) -> Outcome:
    return Outcome(label, sent, 200, ttft, done)


def test_summaries_count_statuses_and_time_completed_requests_only() -> None:
    outcomes = [
        _ok("B", 0.0, 0.2, 1.0),
        _ok("B", 1.0, 0.4, 2.0),
        Outcome("B", 2.0, 429, None, None, "queue timeout"),
        Outcome("B", 3.0, 0, None, None, "ClientError: reset"),
        Outcome("B", 4.0, 200, None, None, "the stream ended without text"),
        _ok("A", 0.0, 9.0, 10.0),
    ]
    summary = summarize(outcomes, "B", "(a)", 2.0)
    assert (summary.sent, summary.completed, summary.refused) == (5, 2, 1)
    assert summary.statuses == {"0": 1, "200": 2, "429": 1}  # the empty stream: not a 200
    assert summary.ttft_ms.p50 == pytest.approx(300.0)
    assert summary.errors == ["ClientError: reset", "the stream ended without text"]


def test_windows_count_completions_by_when_they_ended() -> None:
    outcomes = [_ok("batch", 0, 1, done) for done in (1.0, 9.9, 10.0, 25.0, 31.0)]
    outcomes.append(_ok("interactive", 0, 1, 15.0))
    assert windows(outcomes, "batch", 10.0, 30.0) == [2, 1, 1]  # 31.0 is past the span
    assert windows(outcomes, "batch", 0.0, 30.0) == []
    assert throughput(outcomes, 30.0, skip_s=10.0) == pytest.approx(3 / 20)


def _summary(p99_ms: float, sent: int = 10, completed: int = 10) -> StreamSummary:
    statuses = {"200": completed, "429": sent - completed} if sent > completed else {"200": sent}
    return StreamSummary("B", "x", sent, completed, statuses, Percentiles(1, 1, p99_ms), 1.0, [])


def test_verdicts_hold_to_the_targets() -> None:
    assert fairness_verdict(_summary(100), _summary(150)).passed
    assert not fairness_verdict(_summary(100), _summary(151)).passed
    assert not fairness_verdict(_summary(100), _summary(120, sent=10, completed=9)).passed
    assert not fairness_verdict(_summary(100), None).passed
    assert priority_verdict(_summary(100), _summary(200)).passed
    assert not priority_verdict(_summary(100), _summary(201)).passed
    assert starvation_verdict([3, 1, 2], 10.0).passed
    assert not starvation_verdict([3, 0, 2], 10.0).passed
    assert not starvation_verdict([], 10.0).passed


def test_the_report_shows_every_stream_and_verdict() -> None:
    verdicts = [fairness_verdict(_summary(100), _summary(300)), starvation_verdict([1, 2], 10)]
    report = FlowReport(
        {"engine": "sglang", "max_concurrent": 48, "prefill_cap": 1, "reserve": 1},
        14.5,
        3.3,
        [_summary(300)],
        [1, 2],
        15,
        15,
        verdicts,
    )
    text = render(report)
    assert "| x | B | 1.00 | 10 | 10 | 0 | 0 | 0 | 1 | 300 |" in text
    assert "| (a) B TTFT p99, A flooding / B alone (whole) | 3.00x | <= 1.5x | FAIL |" in text
    assert "| (b) batch completed per 10-s window | 1/2 | every window > 0 | pass |" in text
    assert "14.50 req/s" in text
    assert "--queue-at-worker-caps --worker-queue-reserve 1;" in text


def test_a_missed_target_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    report = FlowReport({}, 1.0, 1.0, [], [0], 0, 0, [starvation_verdict([0], 10.0)])
    monkeypatch.setattr(flow_control, "run_bench", lambda cfg: report)
    with pytest.raises(SystemExit) as exited:
        flow_control.main([])
    assert exited.value.code == 1
