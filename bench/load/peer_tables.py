"""The peer benchmark's printout: the builds, per cell every router's median CPU per request
(min-max) and added p50 latency, then markdown tables of the matrix (ours vs the peer, with the
worst ratio and PASS/FAIL), the regression guard (new/old) and the ledger; failed runs last."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bench.common.table import or_na, text_table
from bench.load.peer_report import (
    ALL_OFF,
    FLOW,
    FLOW_BASE,
    FLOW_KEYS,
    OLD,
    PEER,
    RATIO_LIMIT,
    BuildStats,
    CellSummary,
    FloorRow,
    LedgerRow,
    MatrixRow,
    PeersReport,
    compare_rows,
    matrix_rows,
)
from bench.load.peer_stack import DIRECT, OURS

__all__ = [
    "render",
    "render_compare",
    "render_floors",
    "render_ledger",
    "render_matrix",
    "worst_ratio_line",
]


def us_text(stats: BuildStats | None) -> str:
    """``median (min-max)``, and ``[k/n ok]`` when some runs failed; ``-``: not run here."""
    if stats is None:
        return "-"
    text = or_na(stats.cpu_us, ".0f")
    if stats.cpu_us_min is not None and stats.cpu_us_max is not None and stats.ok > 1:
        text += f" ({stats.cpu_us_min:.0f}-{stats.cpu_us_max:.0f})"
    if stats.ok < stats.runs:
        text += f" [{stats.ok}/{stats.runs} ok]"
    return text


def ms_text(value: float | None) -> str:
    return or_na(value, "+.2f")


def _verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[passed]


def render_matrix(summaries: Sequence[CellSummary]) -> list[str]:
    """Ours vs the peer (markdown), one row per engine and cell, then the worst ratio."""
    lines = [
        "| engine | cell | ours µs | peer µs | ratio | ours +p50 ms | peer +p50 ms | ratio <= 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    stats = {(s.engine, s.cell): s for s in summaries}
    rows = matrix_rows(summaries, OURS, PEER)
    for row in rows:
        s = stats[(row.engine, row.cell)]
        ours, peer = us_text(s.targets.get(OURS)), us_text(s.targets.get(PEER))
        lines.append(
            f"| {row.engine} | {row.cell} | {ours} | {peer} | {or_na(row.ratio, '.2f')} "
            f"| {ms_text(row.ours_added_p50_ms)} | {ms_text(row.peer_added_p50_ms)} "
            f"| {_verdict(row.passed)} |"
        )
    lines.append(worst_ratio_line(rows))
    return lines


def worst_ratio_line(rows: Sequence[MatrixRow]) -> str:
    """The worst ratio, and PASS only when every cell measured both routers at <= 1.0."""
    measured = [row for row in rows if row.ratio is not None]
    if not measured:
        return "worst ratio: n/a (no cell measured both routers): FAIL"
    worst = max(measured, key=lambda row: row.ratio or 0.0)
    passed = sum(1 for row in measured if row.passed)
    verdict = "PASS" if passed == len(rows) else "FAIL"
    return (
        f"worst ratio: {worst.ratio:.2f} ({worst.engine}, {worst.cell}); "
        f"{passed}/{len(rows)} cells <= {RATIO_LIMIT:g}: {verdict}"
    )


def render_compare(summaries: Sequence[CellSummary], new: str = OURS, old: str = OLD) -> list[str]:
    """Ours (new) vs the compare build (old), markdown; also the flow-control build (new) vs
    ours (old)."""
    stats = {(s.engine, s.cell): s for s in summaries}
    lines = [
        "| engine | cell | new µs | old µs | new/old | new +p50 ms | old +p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in compare_rows(summaries, new, old):
        s = stats[(row.engine, row.cell)]
        lines.append(
            f"| {row.engine} | {row.cell} | {us_text(s.targets.get(new))} "
            f"| {us_text(s.targets.get(old))} | {or_na(row.ratio, '.2f')} "
            f"| {ms_text(row.new_added_p50_ms)} | {ms_text(row.old_added_p50_ms)} |"
        )
    return lines


def render_ledger(rows: Sequence[LedgerRow]) -> list[str]:
    """The ledger (markdown): a column per ledger cell, a row per feature, then the sum of the
    single-feature rows (to set against ``everything off``)."""
    if not rows:
        return []
    cells = list(dict.fromkeys(cell for row in rows for cell in row.cost_us))
    lines = [
        "| feature off | " + " | ".join(f"{cell} µs/req" for cell in cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for row in rows:
        name = row.feature if row.known else f"{row.feature} (not a setting: measures nothing)"
        costs = " | ".join(_signed_us(row.cost_us.get(cell)) for cell in cells)
        lines.append(f"| {name} | {costs} |")
    singles = [row for row in rows if row.feature != ALL_OFF]
    sums = " | ".join(_signed_us(_sum(row.cost_us.get(c) for row in singles)) for c in cells)
    lines.append(f"| sum of the single rows | {sums} |")
    return lines


def render_floors(rows: Sequence[FloorRow]) -> list[str]:
    """The floors (markdown): the router's server alone, the bare PD proxy on its parts, ours,
    the peer, and what ours spends (and the peer leaves) above the bare proxy."""
    lines = [
        "| engine | cell | server µs | bare proxy µs | ours µs | peer µs "
        "| ours - proxy µs | peer - proxy µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.engine} | {row.cell} | {or_na(row.server_us, '.0f')} "
            f"| {or_na(row.proxy_us, '.0f')} | {or_na(row.ours_us, '.0f')} "
            f"| {or_na(row.peer_us, '.0f')} | {_signed_us(row.pipeline_us)} "
            f"| {_signed_us(row.room_us)} |"
        )
    return lines


def _signed_us(value: float | None) -> str:
    return or_na(value, "+.0f")


def _sum(values: Iterable[float | None]) -> float | None:
    """The sum; None if any is missing."""
    total = 0.0
    for value in values:
        if value is None:
            return None
        total += value
    return total


def render_cells(report: PeersReport) -> list[str]:
    """Per cell: each router's median CPU µs/req (min-max) and p50 latency added over direct
    (ledger builds only in the ledger table)."""
    names = list(dict.fromkeys(b.name for b in report.builds if b.role != "ledger"))
    rows = [["engine", "cell", "direct p50 ms", *(f"{n} µs (+p50 ms)" for n in names)]]
    for s in report.cells:
        direct = s.targets.get(DIRECT)
        p50 = or_na(None if direct is None else direct.p50_ms, ".2f")
        mine = [f"{us_text(s.targets.get(n))} ({ms_text(s.added_p50(n))})" for n in names]
        rows.append([s.engine, s.cell, p50, *mine])
    return text_table(rows, left=2)


def render(report: PeersReport) -> str:
    env, cfg = report.environment, report.config
    lines = [
        f"peer matrix: repeats={cfg.get('repeats')} requests<={cfg.get('requests')} "
        f"duration<={cfg.get('duration')}s warmup={cfg.get('warmup')}/user "
        f"cpus={env.get('affinity')} commit={env.get('commit') or '?'}",
        *(f"  {b.name:<22} {b.role:<8} {b.kind:<14} {b.router}" for b in report.builds),
        "",
        "router CPU per completed request (router process tree), µs: median (min-max) over "
        "the repeats; +p50 = router p50 latency - direct p50",
        *render_cells(report),
    ]
    if report.matrix:
        lines += ["", "ours vs peer (vllm-mooncake: vllm-router, sglang: sglang-router):"]
        lines += render_matrix(report.cells)
    if report.compare:
        lines += ["", "regression guard, ours (new) vs the compare build (old):"]
        lines += render_compare(report.cells)
    if report.ledger:
        lines += ["", "ledger: what each feature costs, median(all on) - median(that one off):"]
        lines += render_ledger(report.ledger)
    if report.flow:
        lines += ["", f"flow control, {FLOW} (new: keys, tenant limits, a binding queue) vs ours:"]
        lines += render_compare(report.cells, FLOW, OURS)
    if report.flow_keys:
        lines += ["", f"flow control, {FLOW_KEYS} (new: keys and tenant limits only) vs ours:"]
        lines += render_compare(report.cells, FLOW_KEYS, OURS)
    if report.flow_same_shape:
        lines += ["", f"flow control, {FLOW} vs {FLOW_BASE} (the same upstream concurrency):"]
        lines += render_compare(report.cells, FLOW, FLOW_BASE)
    if report.floors:
        lines += ["", "floors: the router's parts without its pipeline (bench.load.floor_app):"]
        lines += render_floors(report.floors)
    if report.failures:
        lines += ["", f"FAILED RUNS ({len(report.failures)}), left out of every median:"]
        lines += [f"  {failure}" for failure in report.failures]
    return "\n".join(lines)
