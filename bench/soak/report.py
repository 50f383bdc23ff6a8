"""The soak's numbers: recovery per fault, totals, targets, and the table that prints them.

Recovery of a fault on one worker is the time from the fault's end until both the router counts
that worker healthy and the worker has answered a completion 200 since (its ``/debug/fault``
count grew, or it is a new process that answered one); of etcd, until the router's registry is
back and a request sent after the end succeeded; of the others, until a request sent after the
end succeeded. "Errors during" counts the main traffic's failed requests (clean or not) that
overlapped the fault or its recovery; "errors after window" and "met" are the targeted rows'
checks (``bench.soak.rows``: the frozen prefill, empty etcd, the KV burst and the attacks; the
other rows are met once recovered).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from bench.soak.cluster import ProcStats, Sample
from bench.soak.faults import ETCD_FAULTS, FaultRun
from bench.soak.rows import UNRECOVERED_WINDOW_S, check
from bench.soak.traffic import Outcome

__all__ = ["FaultRow", "PhaseResult", "Targets", "fault_row", "render", "targets"]

_MAX_SAMPLES = 5
WORKER_FAULTS = frozenset({"prefill_5xx", "decode_sigkill", "prefill_sigstop", "slow_decode"})


@dataclass(frozen=True)
class FaultRow:
    fault: str
    target: str
    start: float
    end: float
    errors_during: int
    recovery_s: float | None  # None: not recovered while the soak watched
    note: str
    top_error: str = ""  # the commonest failure among "errors during", with its count
    errors_after_window: int | None = None  # the targeted rows' (None: not one of them)
    met: bool = True  # recovered, and a targeted row's checks passed
    measures: dict[str, float] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)  # the targeted checks it failed


@dataclass
class PhaseResult:
    """One protocol's run: its requests, faults and the router's resources."""

    engine: str
    wall_s: float
    main: dict[str, int]  # outcome kind -> count
    fault_requests: dict[str, int]  # the same for the requests the faults sent (KV burst)
    statuses: dict[str, int]
    faults: list[FaultRow]
    router_before: ProcStats
    router_mid_rss_kib: int  # half-way through the traffic: warm-up growth vs a steady climb
    router_after: ProcStats
    inflight_after: int
    bad_samples: list[str] = field(default_factory=list)  # hung and unclean details

    @property
    def fd_leak(self) -> int:
        return self.router_after.fds - self.router_before.fds

    @property
    def task_leak(self) -> int:
        return self.router_after.tasks - self.router_before.tasks

    @property
    def rss_drift(self) -> float:
        return self.router_after.rss_kib / self.router_before.rss_kib - 1.0


def _first_ok_after(outcomes: Sequence[Outcome], t: float) -> float | None:
    return min((o.end for o in outcomes if o.ok and o.start >= t), default=None)


def _worker_recovery(run: FaultRun, samples: Sequence[Sample]) -> float | None:
    port = urlsplit(run.target).port
    assert port is not None
    states = [(s.t, s.served.get(port), s.healthy.get(run.target)) for s in samples]
    boot = next((st[0] for t, st, _ in reversed(states) if st and t <= run.start), None)
    served = max((st[1] for t, st, _ in states if st and st[0] == boot and t <= run.end), default=0)
    t_served = next(
        (
            t
            for t, st, _ in states
            if t >= run.end and st and (st[1] > served if st[0] == boot else st[1] > 0)
        ),
        None,
    )
    t_healthy = next((t for t, _, ok in states if t >= run.end and ok), None)
    if t_served is None or t_healthy is None:
        return None
    return max(t_served, t_healthy) - run.end


def _recovery(run: FaultRun, samples: Sequence[Sample], main: Sequence[Outcome]) -> float | None:
    if run.spec.kind in WORKER_FAULTS:
        return _worker_recovery(run, samples)
    first_ok = _first_ok_after(main, run.end)
    if first_ok is None:
        return None
    if run.spec.kind in ETCD_FAULTS:
        back = next((s.t for s in samples if s.t >= run.end and s.registry_ok), None)
        return None if back is None else max(back, first_ok) - run.end
    return first_ok - run.end


def fault_row(run: FaultRun, samples: Sequence[Sample], main: Sequence[Outcome]) -> FaultRow:
    recovery = _recovery(run, samples, main)
    until = run.end + (UNRECOVERED_WINDOW_S if recovery is None else recovery)
    failed = [o for o in main if not o.ok and o.start <= until and o.end >= run.start]
    common = Counter(f"{o.status} {o.detail[:90]}" for o in failed).most_common(1)
    top = f"{common[0][1]}x {common[0][0]}" if common else ""
    checked = check(run, samples, main, recovery)
    note = "; ".join(part for part in (run.note, checked.summary) if part)
    return FaultRow(
        run.label,
        run.target,
        run.start,
        run.end,
        len(failed),
        recovery,
        note,
        top,
        checked.errors_after_window,
        recovery is not None and not checked.misses,
        checked.measures,
        checked.misses,
    )


def counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    found = Counter(o.kind for o in outcomes)
    return {kind: found[kind] for kind in ("ok", "error", "unclean", "hung")}


def bad_samples(outcomes: Sequence[Outcome]) -> list[str]:
    bad = [o for o in outcomes if o.kind in ("unclean", "hung")]
    return [
        f"{o.kind} {o.tag} stream={o.stream} status={o.status} t={o.start:.1f}-{o.end:.1f}: "
        f"{o.detail}"
        for o in bad[:_MAX_SAMPLES]
    ]


@dataclass(frozen=True)
class Targets:
    hung: int
    unclean: int
    fd_leak: int
    task_leak: int
    rss_drift: float
    inflight_after: int
    unrecovered: int
    errors_after_window: int = 0  # summed over the targeted rows
    rows_missed: int = 0  # targeted rows that missed a check

    def met(self, fd_slack: int) -> bool:
        return (
            self.hung == 0
            and self.unclean == 0
            and self.fd_leak <= fd_slack
            and self.task_leak <= 0
            and self.rss_drift <= 0.10
            and self.inflight_after == 0
            and self.unrecovered == 0
            and self.errors_after_window == 0
            and self.rows_missed == 0
        )


def targets(phases: Sequence[PhaseResult]) -> Targets:
    return Targets(
        hung=sum(p.main["hung"] + p.fault_requests["hung"] for p in phases),
        unclean=sum(p.main["unclean"] + p.fault_requests["unclean"] for p in phases),
        fd_leak=max((p.fd_leak for p in phases), default=0),
        task_leak=max((p.task_leak for p in phases), default=0),
        rss_drift=max((p.rss_drift for p in phases), default=0.0),
        inflight_after=sum(p.inflight_after for p in phases),
        unrecovered=sum(1 for p in phases for f in p.faults if f.recovery_s is None),
        errors_after_window=sum(f.errors_after_window or 0 for p in phases for f in p.faults),
        rows_missed=sum(1 for p in phases for f in p.faults if f.misses),
    )


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def _fault_cells(engine: str, row: FaultRow) -> list[str]:
    recovery = "not recovered" if row.recovery_s is None else f"{row.recovery_s:.2f}"
    return [
        engine,
        row.fault,
        row.target,
        f"{row.start:.1f}",
        f"{row.end:.1f}",
        str(row.errors_during),
        "-" if row.errors_after_window is None else str(row.errors_after_window),
        recovery,
        "yes" if row.met else "NO",
        row.note,
    ]


def _phase_lines(p: PhaseResult) -> list[str]:
    b, a = p.router_before, p.router_after
    return [
        f"{p.engine}: {sum(p.main.values())} requests in {p.wall_s:.0f} s: {p.main}; "
        f"fault-sent requests: {p.fault_requests}; statuses {p.statuses}",
        f"  router fds {b.fds} -> {a.fds} (leak {p.fd_leak}), RSS {b.rss_kib / 1024:.1f} -> "
        f"{p.router_mid_rss_kib / 1024:.1f} (half-way) -> {a.rss_kib / 1024:.1f} MiB "
        f"(drift {100 * p.rss_drift:+.1f}%), threads {b.threads} -> {a.threads}, asyncio tasks "
        f"{b.tasks} -> {a.tasks} (leak {p.task_leak}), requests in flight at the router after "
        f"settling: {p.inflight_after}",
        *(f"  {line}" for line in p.bad_samples),
        *(f"  {f.fault}: {f.top_error}" for f in p.faults if f.top_error),
        *(f"  {f.fault} missed: {'; '.join(f.misses)}" for f in p.faults if f.misses),
    ]


def render(phases: Sequence[PhaseResult], fd_slack: int) -> str:
    header = ["engine", "fault", "target", "start s", "end s", "errors during"]
    header += ["errors after window", "recovery s", "met", "note"]
    rows = [header] + [_fault_cells(p.engine, f) for p in phases for f in p.faults]
    t = targets(phases)
    verdict = "all targets met" if t.met(fd_slack) else "TARGETS MISSED"
    lines = [
        *_table(rows),
        "",
        *(line for p in phases for line in _phase_lines(p)),
        "",
        f"totals: hung {t.hung} (target 0), no clean outcome {t.unclean} (target 0), "
        f"router fd leak {t.fd_leak} (target 0, slack {fd_slack}), task leak {t.task_leak} "
        f"(target 0), RSS drift "
        f"{100 * t.rss_drift:+.1f}% (target <= 10%), in flight after settling "
        f"{t.inflight_after} (target 0), faults not recovered {t.unrecovered} (target 0), "
        f"errors after the detection window {t.errors_after_window} (target 0), rows missed "
        f"{t.rows_missed} (target 0): {verdict}",
    ]
    return "\n".join(lines)
