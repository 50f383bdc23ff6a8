"""The arithmetic and tables of ``bench.load.workers``: one run's record from what it measured,
the median row of each (N, sockets) over the repeats, the scaling efficiency, the rendering.

Per request always means per completed request of the run (all load generators together).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from bench.common.table import or_na, text_table
from bench.load.loadgen_group import Share

__all__ = [
    "BUSY_WARNING",
    "SINGLE",
    "TARGET_EFFICIENCY",
    "Measured",
    "Report",
    "Row",
    "RunRecord",
    "make_record",
    "make_rows",
    "render",
    "render_markdown",
]

TARGET_EFFICIENCY = 0.8
BUSY_WARNING = 0.9  # a helper process this busy may have limited the run, not the router
SINGLE = "-"  # the sockets column of N = 1: one process on its own, no supervisor, no flag
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class RunRecord(msgspec.Struct, frozen=True):
    """One measured run of N router processes; ``ok`` False (``failure`` says why) keeps it out
    of every median. CPU figures are µs per completed request; busy = CPU / window."""

    n: int
    sockets: str
    repeat: int
    ok: bool = False
    failure: str | None = None
    loadgens: int = 0
    completed: int = 0
    errors: int = 0
    window_s: float = 0.0  # first load generator's start to the last one's end
    start_skew_ms: float = 0.0
    rps: float = 0.0
    p50_ms: float | None = None  # the load generators' p50s weighted by their completed
    p99_ms: float | None = None  # the worst load generator's p99
    router_us: float | None = None  # the whole process tree, supervisor included
    process_us: list[float] = msgspec.field(default_factory=list)  # per completed / N
    process_busy: list[float] = msgspec.field(default_factory=list)
    supervisor_us: float | None = None  # None: N = 1, no supervisor
    resolution_us: float | None = None  # one clock tick per request
    fakes_us: float | None = None
    fakes_busy_max: float | None = None
    loadgen_us: float | None = None
    loadgen_busy_max: float | None = None


@dataclass(frozen=True)
class Measured:
    """What one run read: the load generators' shares and the CPU seconds spent over the
    measured phase (``cpu_window_s``) by the router's tree, its root process, each serving
    process and each fake engine."""

    shares: Sequence[Share]
    cpu_window_s: float
    tree_s: float
    root_s: float
    serving_s: Sequence[float]
    fakes_s: Sequence[float]
    supervised: bool


def _failure(completed: int, errors: int, shares: Sequence[Share]) -> str | None:
    if errors:
        samples = "; ".join(s for share in shares for s in share.load.error_samples[:2])
        return f"{errors} request errors ({completed} completed): {samples}"
    return None if completed else "no request completed"


def _latency(shares: Sequence[Share]) -> tuple[float | None, float | None]:
    counted = [share.load for share in shares if share.load.completed]
    if not counted:
        return None, None
    total = sum(load.completed for load in counted)
    p50 = sum(load.latency_ms.p50 * load.completed for load in counted) / total
    return p50, max(load.latency_ms.p99 for load in counted)


def _loadgen(shares: Sequence[Share], per_us: float) -> tuple[float, float]:
    loads = [share.load for share in shares]
    busy = max(load.loadgen_cpu_s / load.wall_s if load.wall_s > 0 else 0.0 for load in loads)
    return sum(load.loadgen_cpu_s for load in loads) * per_us, busy


def make_record(where: RunRecord, m: Measured) -> RunRecord:
    """``where`` (n, sockets, repeat) filled in from ``m``."""
    completed = sum(share.load.completed for share in m.shares)
    errors = sum(share.load.errors for share in m.shares)
    starts, ends = [s.started for s in m.shares], [s.ended for s in m.shares]
    window = max(ends) - min(starts)
    per_us = 1e6 / max(completed, 1)
    per_process_us = per_us * len(m.serving_s)  # each process's CPU per its even share
    cpu_window = max(m.cpu_window_s, 1e-9)
    p50, p99 = _latency(m.shares)
    loadgen_us, loadgen_busy = _loadgen(m.shares, per_us)
    failure = _failure(completed, errors, m.shares)
    return msgspec.structs.replace(
        where,
        ok=failure is None,
        failure=failure,
        loadgens=len(m.shares),
        completed=completed,
        errors=errors,
        window_s=window,
        start_skew_ms=1000.0 * (max(starts) - min(starts)),
        rps=completed / window if window > 0 else 0.0,
        p50_ms=p50,
        p99_ms=p99,
        router_us=m.tree_s * per_us,
        process_us=[s * per_process_us for s in m.serving_s],
        process_busy=[s / cpu_window for s in m.serving_s],
        supervisor_us=m.root_s * per_us if m.supervised else None,
        resolution_us=_TICK_S * per_us,
        fakes_us=sum(m.fakes_s) * per_us,
        fakes_busy_max=max(m.fakes_s, default=0.0) / cpu_window,
        loadgen_us=loadgen_us,
        loadgen_busy_max=loadgen_busy,
    )


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


class Row(msgspec.Struct, frozen=True):
    """The medians over the runs of one (N, sockets) that counted."""

    n: int
    sockets: str
    runs: int
    failed: int
    rps: float | None = None
    efficiency: float | None = None  # rps / (N x rps at N = 1)
    router_us: float | None = None
    process_us: float | None = None  # median process of a run, median over runs
    spread: float | None = None  # max / min of the processes' CPU, median over runs
    supervisor_us: float | None = None
    resolution_us: float | None = None
    ceiling_rps: float | None = None  # 1e6 / supervisor_us: what the serial part allows
    p50_ms: float | None = None
    p99_ms: float | None = None
    router_busy: float | None = None  # mean over the serving processes
    fakes_busy_max: float | None = None
    loadgen_busy_max: float | None = None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _spread(values: Sequence[float]) -> float | None:
    return max(values) / min(values) if values and min(values) > 0 else None


def _row(n: int, sockets: str, runs: Sequence[RunRecord]) -> Row:
    ok = [r for r in runs if r.ok]
    if not ok:
        return Row(n, sockets, 0, len(runs))
    sup = _median([r.supervisor_us for r in ok])
    resolution = _median([r.resolution_us for r in ok])
    measurable = sup is not None and resolution is not None and sup >= resolution
    return Row(
        n,
        sockets,
        len(ok),
        len(runs) - len(ok),
        rps=_median([r.rps for r in ok]),
        router_us=_median([r.router_us for r in ok]),
        process_us=_median([_median(r.process_us) for r in ok]),
        spread=_median([_spread(r.process_us) for r in ok]),
        supervisor_us=sup,
        resolution_us=resolution,
        ceiling_rps=1e6 / sup if measurable and sup else None,
        p50_ms=_median([r.p50_ms for r in ok]),
        p99_ms=_median([r.p99_ms for r in ok]),
        router_busy=_median([statistics.fmean(r.process_busy) for r in ok if r.process_busy]),
        fakes_busy_max=_median([r.fakes_busy_max for r in ok]),
        loadgen_busy_max=_median([r.loadgen_busy_max for r in ok]),
    )


def make_rows(records: Sequence[RunRecord]) -> list[Row]:
    """One row per (N, sockets) in the order first run, with the efficiency against N = 1."""
    keys = list(dict.fromkeys((r.n, r.sockets) for r in records))
    rows = [_row(n, s, [r for r in records if (r.n, r.sockets) == (n, s)]) for n, s in keys]
    base = next((row.rps for row in rows if row.n == 1 and row.rps), None)
    return [
        msgspec.structs.replace(row, efficiency=row.rps / (row.n * base))
        if base and row.rps is not None
        else row
        for row in rows
    ]


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


class Report(msgspec.Struct, frozen=True):
    config: dict[str, object]
    environment: dict[str, object]
    placements: dict[str, str]  # N -> where its processes ran
    rows: list[Row]
    records: list[RunRecord]
    failures: list[str]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def supervisor_cell(row: Row) -> str:
    """The supervisor's CPU per request and the ceiling it implies, or why there is none."""
    if row.n == 1 or row.rps is None:
        return "n/a"
    if row.supervisor_us is None or row.ceiling_rps is None:
        return f"none measurable (<{or_na(row.resolution_us, '.2f')})"
    return f"{row.supervisor_us:.2f} (ceiling {row.ceiling_rps:,.0f} req/s)"


def _process_cell(row: Row) -> str:
    spread = "" if row.spread is None else f" ({row.spread:.2f}x)"
    return or_na(row.process_us, ".0f") + spread


def _human_cells(row: Row) -> list[str]:
    return [
        str(row.n),
        row.sockets,
        f"{row.runs}/{row.runs + row.failed}",
        or_na(row.rps, ".0f"),
        or_na(row.efficiency, ".2f"),
        or_na(row.router_us, ".0f"),
        _process_cell(row),
        supervisor_cell(row),
        or_na(row.p50_ms, ".2f"),
        or_na(row.p99_ms, ".2f"),
        _pct(row.router_busy),
        _pct(row.fakes_busy_max),
        _pct(row.loadgen_busy_max),
    ]


_HUMAN = [
    "N",
    "sockets",
    "runs",
    "req/s",
    "eff",
    "CPU µs/req",
    "per-process µs/req (max/min)",
    "supervisor µs/req",
    "p50 ms",
    "p99 ms",
    "router busy",
    "fake max busy",
    "loadgen max busy",
]


def verdicts(rows: Sequence[Row]) -> list[str]:
    """The efficiency target per N > 1, and the rows whose helpers may have been the limit."""
    lines = []
    for row in rows:
        if row.n == 1 or row.efficiency is None:
            continue
        verdict = "PASS" if row.efficiency >= TARGET_EFFICIENCY else "FAIL"
        lines.append(
            f"  {verdict}  N={row.n} {row.sockets}: efficiency {row.efficiency:.2f} "
            f"(target >= {TARGET_EFFICIENCY})"
        )
    if not lines:
        lines.append("  ----  no efficiency: it needs N = 1 and an N > 1 that both ran")
    for row in rows:
        busiest = max(row.fakes_busy_max or 0.0, row.loadgen_busy_max or 0.0)
        if busiest >= BUSY_WARNING:
            lines.append(
                f"  NOTE  N={row.n} {row.sockets}: a fake or load generator was "
                f"{_pct(busiest)} busy: the router may not have been the limit"
            )
    return lines


def render(report: Report) -> str:
    """The human table, the targets and the placements."""
    lines = text_table([_HUMAN, *(_human_cells(row) for row in report.rows)], left=2)
    lines += ["", "targets:", *verdicts(report.rows), "", "placement:"]
    lines += [f"  N={n}: {where}" for n, where in report.placements.items()]
    if report.failures:
        lines += ["", "FAILED RUNS:", *(f"  {failure}" for failure in report.failures)]
    return "\n".join(lines)


def render_markdown(rows: Sequence[Row]) -> str:
    """The markdown table for docs/performance.md."""
    head = (
        "| N | sockets | req/s | efficiency | CPU µs/req | per-process µs/req (spread) "
        "| supervisor µs/req | p50 ms | p99 ms |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = _human_cells(row)
        lines.append("| " + " | ".join([*cells[:2], *cells[3:10]]) + " |")
    return "\n".join(lines)
