"""The peer benchmark's arithmetic and its report: per cell and router build the median CPU per
request (with min-max) and p50 latency added over a direct request; the matrix of ours against
the peer (ratio and PASS/FAIL of ratio <= 1.0), the comparison against another build of ours,
the ledger of what each feature costs (median all on - median that one off), and the floors
(``bench.load.floor_app``: what the router's server alone and its bare PD proxying cost).

Pure functions over ``RunRecord``s: no process, no clock. ``peer_tables`` renders them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import msgspec

from bench.load.peer_stack import DIRECT, OURS, Cell, RunRecord

__all__ = [
    "ALL_OFF",
    "FLOW",
    "FLOW_BASE",
    "FLOW_KEYS",
    "OLD",
    "PEER",
    "BuildInfo",
    "BuildStats",
    "CellSummary",
    "CompareRow",
    "FloorRow",
    "LedgerRow",
    "MatrixRow",
    "PeersReport",
    "compare_rows",
    "floor_rows",
    "ledger_rows",
    "make_report",
    "matrix_rows",
    "summarize",
]

ALL_OFF = "everything off"
PEER, OLD = "peer", "old"  # the build names of the peer and of the compare build
FLOOR_SERVER, FLOOR_PROXY = "floor-server", "floor-proxy"  # the floors' build names
FLOW = "ours-flow-control"  # ours with API keys, tenant limits and a binding admission queue
FLOW_KEYS = "ours-flow-keys"  # ... with the keys and limits only (the queue never binds)
# ours, its load at the concurrency FLOW admits: FLOW's upstream shape, nobody waiting
FLOW_BASE = "ours-at-flow-concurrency"
RATIO_LIMIT = 1.0  # ours / peer, per cell (issue 22, requirement 1)


class BuildStats(msgspec.Struct, frozen=True):
    """One target's runs in one cell: the runs that counted and their medians (None: no run
    counted)."""

    runs: int
    ok: int
    cpu_us: float | None  # median router CPU per request
    cpu_us_min: float | None
    cpu_us_max: float | None
    p50_ms: float | None  # median of the runs' p50 latency


class CellSummary(msgspec.Struct, frozen=True):
    engine: str
    cell: str
    tokens: int
    concurrency: int
    stream: bool
    targets: dict[str, BuildStats]  # build name (or "direct") -> its stats

    def cpu(self, target: str) -> float | None:
        stats = self.targets.get(target)
        return None if stats is None else stats.cpu_us

    def added_p50(self, target: str) -> float | None:
        """``target``'s p50 latency minus the direct request's, in ms."""
        mine, direct = self.targets.get(target), self.targets.get(DIRECT)
        if mine is None or direct is None or mine.p50_ms is None or direct.p50_ms is None:
            return None
        return mine.p50_ms - direct.p50_ms


def median(values: Iterable[float]) -> float | None:
    """The median; None for no values."""
    ordered = sorted(values)
    return statistics.median(ordered) if ordered else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def difference(minuend: float | None, subtrahend: float | None) -> float | None:
    return None if minuend is None or subtrahend is None else minuend - subtrahend


def build_stats(records: Sequence[RunRecord]) -> BuildStats:
    """Medians over the runs that counted (``ok``)."""
    good = [r for r in records if r.ok]
    cpu = [r.router_cpu_us for r in good if r.router_cpu_us is not None]
    p50 = [r.latency_p50_ms for r in good if r.latency_p50_ms is not None]
    return BuildStats(
        runs=len(records),
        ok=len(good),
        cpu_us=median(cpu),
        cpu_us_min=min(cpu, default=None),
        cpu_us_max=max(cpu, default=None),
        p50_ms=median(p50),
    )


def summarize(records: Sequence[RunRecord]) -> list[CellSummary]:
    """One summary per (engine, cell), in the order the cells were first run."""
    groups: dict[tuple[str, Cell], dict[str, list[RunRecord]]] = {}
    for record in records:
        cell = Cell(record.tokens, record.concurrency, record.stream)
        groups.setdefault((record.engine, cell), {}).setdefault(record.target, []).append(record)
    return [
        CellSummary(
            engine=engine,
            cell=cell.label,
            tokens=cell.tokens,
            concurrency=cell.concurrency,
            stream=cell.stream,
            targets={name: build_stats(runs) for name, runs in by_target.items()},
        )
        for (engine, cell), by_target in groups.items()
    ]


# ---------------------------------------------------------------------------------------------
# The matrix: ours against the peer
# ---------------------------------------------------------------------------------------------


class MatrixRow(msgspec.Struct, frozen=True):
    engine: str
    cell: str
    ours_us: float | None
    peer_us: float | None
    ratio: float | None  # ours / peer
    ours_added_p50_ms: float | None
    peer_added_p50_ms: float | None
    passed: bool | None  # ratio <= 1.0; None when either side has no run that counted


def matrix_rows(summaries: Sequence[CellSummary], ours: str, peer: str) -> list[MatrixRow]:
    rows = []
    for s in summaries:
        if ours not in s.targets:
            continue
        r = ratio(s.cpu(ours), s.cpu(peer))
        rows.append(
            MatrixRow(
                engine=s.engine,
                cell=s.cell,
                ours_us=s.cpu(ours),
                peer_us=s.cpu(peer),
                ratio=r,
                ours_added_p50_ms=s.added_p50(ours),
                peer_added_p50_ms=s.added_p50(peer),
                passed=None if r is None else r <= RATIO_LIMIT,
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# The regression guard: ours against another build of ours
# ---------------------------------------------------------------------------------------------


class CompareRow(msgspec.Struct, frozen=True):
    engine: str
    cell: str
    new_us: float | None
    old_us: float | None
    ratio: float | None  # new / old
    new_added_p50_ms: float | None
    old_added_p50_ms: float | None


def compare_rows(summaries: Sequence[CellSummary], new: str, old: str) -> list[CompareRow]:
    return [
        CompareRow(
            engine=s.engine,
            cell=s.cell,
            new_us=s.cpu(new),
            old_us=s.cpu(old),
            ratio=ratio(s.cpu(new), s.cpu(old)),
            new_added_p50_ms=s.added_p50(new),
            old_added_p50_ms=s.added_p50(old),
        )
        for s in summaries
        if new in s.targets and old in s.targets
    ]


# ---------------------------------------------------------------------------------------------
# The ledger: what each feature costs
# ---------------------------------------------------------------------------------------------


class LedgerRow(msgspec.Struct, frozen=True):
    """What one feature (or ``everything off``) costs per request in each ledger cell:
    median(ours, all on) - median(ours, that one off), in µs; None where not measured."""

    feature: str
    build: str
    cost_us: dict[str, float | None]  # "ENGINE CELL" -> µs per request
    known: bool  # False: the router has no such setting, so the row measures nothing


def ledger_rows(
    summaries: Sequence[CellSummary],
    ours: str,
    builds: Sequence[tuple[str, str]],
    unknown: frozenset[str] = frozenset(),
) -> list[LedgerRow]:
    """``builds``: (feature, build name) pairs, ``everything off`` included; the cells are those
    where the feature builds ran."""
    rows = []
    for feature, build in builds:
        cost = {
            f"{s.engine} {s.cell}": difference(s.cpu(ours), s.cpu(build))
            for s in summaries
            if build in s.targets
        }
        known = not unknown if feature == ALL_OFF else feature not in unknown
        rows.append(LedgerRow(feature, build, cost, known))
    return rows


# ---------------------------------------------------------------------------------------------
# The floors: the router's own parts without its pipeline
# ---------------------------------------------------------------------------------------------


class FloorRow(msgspec.Struct, frozen=True):
    """One cell's floors: ``pipeline_us`` is what ours costs above the bare proxy on its own
    parts; ``room_us`` what the peer leaves above that proxy (negative: even the bare proxy
    costs more than the peer)."""

    engine: str
    cell: str
    server_us: float | None  # the router's server answering by itself
    proxy_us: float | None  # the bare PD proxy on the router's server and client
    ours_us: float | None
    peer_us: float | None
    pipeline_us: float | None  # ours - proxy
    room_us: float | None  # peer - proxy


def floor_rows(summaries: Sequence[CellSummary]) -> list[FloorRow]:
    rows = []
    for s in summaries:
        if FLOOR_PROXY not in s.targets and FLOOR_SERVER not in s.targets:
            continue
        proxy, ours, peer = s.cpu(FLOOR_PROXY), s.cpu(OURS), s.cpu(PEER)
        rows.append(
            FloorRow(
                engine=s.engine,
                cell=s.cell,
                server_us=s.cpu(FLOOR_SERVER),
                proxy_us=proxy,
                ours_us=ours,
                peer_us=peer,
                pipeline_us=difference(ours, proxy),
                room_us=difference(peer, proxy),
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# The whole report
# ---------------------------------------------------------------------------------------------


class BuildInfo(msgspec.Struct, frozen=True):
    """A router build as the report shows it."""

    name: str
    kind: str
    role: str  # ours, peer, compare, ledger or floor
    features_off: list[str]
    router: str  # where its ``router`` package is imported from (builds of ours), else the kind


class PeersReport(msgspec.Struct, frozen=True):
    config: dict[str, object]
    environment: dict[str, object]
    builds: list[BuildInfo]
    records: list[RunRecord]
    cells: list[CellSummary]
    matrix: list[MatrixRow]
    compare: list[CompareRow]
    ledger: list[LedgerRow]
    failures: list[str]
    floors: list[FloorRow] = []
    flow: list[CompareRow] = []  # ours with flow control (new) against ours (old)
    flow_keys: list[CompareRow] = []  # ours with keys and limits only (new) against ours
    # FLOW (new) against FLOW_BASE: the same upstream concurrency, so what is left is the
    # keys', the limits' and the queue's own work (not fewer requests sharing each turn)
    flow_same_shape: list[CompareRow] = []


def ledger_builds(builds: Sequence[BuildInfo]) -> list[tuple[str, str]]:
    """(feature, build name) of each ledger build; ``everything off`` for the one with more."""
    return [
        (b.features_off[0] if len(b.features_off) == 1 else ALL_OFF, b.name)
        for b in builds
        if b.role == "ledger"
    ]


def failure_lines(records: Sequence[RunRecord]) -> list[str]:
    return [
        f"{r.engine} {Cell(r.tokens, r.concurrency, r.stream).label} #{r.repeat + 1} "
        f"{r.target}: {r.failure}"
        for r in records
        if not r.ok
    ]


def make_report(
    config: dict[str, object],
    environment: dict[str, object],
    builds: Sequence[BuildInfo],
    records: Sequence[RunRecord],
    unknown: frozenset[str] = frozenset(),
) -> PeersReport:
    """Everything, from the runs: ``unknown`` names the ledger features the router lacks."""
    cells = summarize(records)
    roles = {b.role for b in builds}
    return PeersReport(
        config=config,
        environment=environment,
        builds=list(builds),
        records=list(records),
        cells=cells,
        matrix=matrix_rows(cells, OURS, PEER) if PEER in roles else [],
        compare=compare_rows(cells, OURS, OLD) if "compare" in roles else [],
        ledger=ledger_rows(cells, OURS, ledger_builds(builds), unknown),
        failures=failure_lines(records),
        floors=floor_rows(cells),
        flow=compare_rows(cells, FLOW, OURS) if "flow" in roles else [],
        flow_keys=compare_rows(cells, FLOW_KEYS, OURS) if "flow" in roles else [],
        flow_same_shape=compare_rows(cells, FLOW, FLOW_BASE) if "flow" in roles else [],
    )
