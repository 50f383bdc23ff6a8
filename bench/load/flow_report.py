"""The figures of ``bench.load.flow_control`` from its requests' outcomes: per-stream summaries,
completions per window, the verdicts against issue 25's targets, and the markdown report."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import msgspec

from bench.common.stats import Percentiles, percentiles
from bench.load.flow_load import Outcome

__all__ = [
    "FAIRNESS_TARGET",
    "PRIORITY_TARGET",
    "FlowReport",
    "StreamSummary",
    "Verdict",
    "fairness_verdict",
    "priority_verdict",
    "render",
    "starvation_verdict",
    "summarize",
    "windows",
]

FAIRNESS_TARGET = 1.5  # (a): the other tenant's TTFT p99 under the flood / alone
PRIORITY_TARGET = 2.0  # (b): interactive TTFT p99 at 2x capacity / unloaded


class StreamSummary(msgspec.Struct, frozen=True):
    """One stream's requests in one phase."""

    label: str
    phase: str
    sent: int
    completed: int
    statuses: dict[str, int]  # HTTP status (or "0": no answer) -> requests
    ttft_ms: Percentiles  # of the completed requests
    rate: float  # offered, requests/s
    errors: list[str]  # a few samples of what failed (not 429/503)

    @property
    def refused(self) -> int:
        return self.statuses.get("429", 0) + self.statuses.get("503", 0)


class Verdict(msgspec.Struct, frozen=True):
    figure: str
    measured: str
    target: str
    passed: bool


class FlowReport(msgspec.Struct, frozen=True):
    config: dict[str, object]
    capacity_rps: float
    service_s: float
    summaries: list[StreamSummary]
    batch_windows: list[int]  # batch completions per window during the loaded phase (b)
    flood_throughput_rps: float  # completions/s of both tenants during the flood (a)
    overload_throughput_rps: float  # completions/s of both classes at 2x capacity (b)
    verdicts: list[Verdict]
    prefill_s: float = 0.0  # unloaded TTFT: how long a request holds a prefill's place
    capacity_note: str = ""  # what bounds the capacity: the slots or the prefills' places

    def summary(self, phase: str, label: str) -> StreamSummary | None:
        found = [s for s in self.summaries if s.phase == phase and s.label == label]
        return found[0] if found else None


def summarize(
    outcomes: Sequence[Outcome], label: str, phase: str, rate: float, samples: int = 3
) -> StreamSummary:
    """The requests of ``label`` among ``outcomes``."""
    mine = [o for o in outcomes if o.label == label]
    statuses = Counter(str(o.status) for o in mine if not o.completed)
    completed = [o for o in mine if o.completed]
    if completed:
        statuses["200"] = len(completed)
    errors = [o.error for o in mine if not o.completed and o.status not in (429, 503)]
    ttfts = [o.ttft_s for o in completed if o.ttft_s is not None]
    return StreamSummary(
        label,
        phase,
        len(mine),
        len(completed),
        dict(sorted(statuses.items())),
        percentiles(ttfts),
        rate,
        errors[:samples],
    )


def windows(outcomes: Sequence[Outcome], label: str, window_s: float, span_s: float) -> list[int]:
    """Completions of ``label`` per ``window_s`` window of ``[0, span_s)``, by when they ended
    (s after the phase began); completions after ``span_s`` are not counted."""
    if window_s <= 0 or span_s <= 0:
        return []
    counts = [0] * math.ceil(span_s / window_s - 1e-9)
    for outcome in outcomes:
        if outcome.label == label and outcome.done_s is not None and outcome.done_s < span_s:
            counts[min(int(outcome.done_s // window_s), len(counts) - 1)] += 1
    return counts


def throughput(outcomes: Sequence[Outcome], span_s: float, skip_s: float) -> float:
    """Completions per second that ended within ``[skip_s, span_s)`` (steady state)."""
    if span_s <= skip_s:
        return 0.0
    ended = [o for o in outcomes if o.done_s is not None and skip_s <= o.done_s < span_s]
    return len(ended) / (span_s - skip_s)


def _ratio(loaded: StreamSummary | None, alone: StreamSummary | None) -> float:
    if loaded is None or alone is None or not loaded.completed or not alone.completed:
        return math.nan
    return loaded.ttft_ms.p99 / alone.ttft_ms.p99 if alone.ttft_ms.p99 > 0 else math.nan


def fairness_verdict(
    alone: StreamSummary | None, flooded: StreamSummary | None, steady: bool = False
) -> Verdict:
    """(a): the other tenant's TTFT p99 under the flood within 1.5x of alone, none refused
    (``steady``: the flood's onset left out)."""
    figure = "(a) B TTFT p99, A flooding / B alone"
    return _p99_verdict(figure, alone, flooded, FAIRNESS_TARGET, "<= 1.5x", steady)


def priority_verdict(
    unloaded: StreamSummary | None, loaded: StreamSummary | None, steady: bool = False
) -> Verdict:
    """(b): interactive TTFT p99 at 2x capacity within 2x of unloaded, none refused
    (``steady``: the overload's onset left out)."""
    figure = "(b) interactive TTFT p99, 2x capacity / unloaded"
    return _p99_verdict(figure, unloaded, loaded, PRIORITY_TARGET, "<= 2x", steady)


def _p99_verdict(
    figure: str,
    baseline: StreamSummary | None,
    loaded: StreamSummary | None,
    target: float,
    target_text: str,
    steady: bool,
) -> Verdict:
    """``loaded``'s TTFT p99 over ``baseline``'s within ``target``, none of it refused."""
    ratio = _ratio(loaded, baseline)
    refused = loaded.sent - loaded.completed if loaded is not None else 0
    passed = ratio <= target and refused == 0
    measured = f"{ratio:.2f}x" + (f", {refused} not served" if refused else "")
    figure += " (steady)" if steady else " (whole)"
    return Verdict(figure, measured, target_text, passed)


def starvation_verdict(batch_windows: Sequence[int], window_s: float) -> Verdict:
    """(b): batch completes requests in every window (no starvation)."""
    passed = bool(batch_windows) and min(batch_windows) > 0
    measured = "/".join(str(n) for n in batch_windows) or "no windows"
    return Verdict(
        f"(b) batch completed per {window_s:g}-s window", measured, "every window > 0", passed
    )


_HEADER = (
    "| phase | stream | offered req/s | sent | 200 | 429 | 503 | other | TTFT p50 ms | p99 ms |"
)


def _row(s: StreamSummary) -> str:
    other = s.sent - s.completed - s.refused
    ttft = s.ttft_ms
    return (
        f"| {s.phase} | {s.label} | {s.rate:.2f} | {s.sent} | {s.completed} | "
        f"{s.statuses.get('429', 0)} | {s.statuses.get('503', 0)} | {other} | "
        f"{ttft.p50:.0f} | {ttft.p99:.0f} |"
    )


def _caps(cap: object, reserve: object) -> str:
    if not cap:
        return ""
    held = f" --worker-queue-reserve {reserve}" if reserve else ""
    return f" --max-inflight-per-prefill {cap} --queue-at-worker-caps{held}"


def render(report: FlowReport) -> str:
    """The markdown report: the setting, the streams, the verdicts."""
    cfg = report.config
    worker_args = cfg.get("worker_args")
    args = " ".join(map(str, worker_args)) if isinstance(worker_args, list | tuple) else ""
    lines = [
        f"flow_control: pd-cluster {cfg.get('prefills')}P1D --engine {cfg.get('engine')}, router "
        f"--max-concurrent-requests {cfg.get('max_concurrent')} --queue-timeout "
        f"{cfg.get('queue_timeout_s')} --priority-aging {cfg.get('priority_aging_s')}"
        f"{_caps(cfg.get('prefill_cap'), cfg.get('reserve'))}; "
        f"prompt {cfg.get('prompt_tokens')} tokens, max_tokens {cfg.get('max_tokens')} "
        f"+- {100 * float(str(cfg.get('spread', 0.0))):.0f}%; "
        f"worker args: {args or '(defaults)'}",
        f"capacity: {report.capacity_rps:.2f} req/s ({report.capacity_note or 'slots'}); "
        f"unloaded: {report.service_s:.2f} s per request, TTFT {report.prefill_s:.3f} s; "
        f"completions during the "
        f"flood (a) {report.flood_throughput_rps:.2f} req/s, at 2x capacity (b) "
        f"{report.overload_throughput_rps:.2f} req/s",
        "",
        _HEADER,
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_row(s) for s in report.summaries),
        "",
        "| figure | measured | target | verdict |",
        "|---|---|---|---|",
        *(
            f"| {v.figure} | {v.measured} | {v.target} | {'pass' if v.passed else 'FAIL'} |"
            for v in report.verdicts
        ),
    ]
    errors = [f"  {s.phase} {s.label}: {e}" for s in report.summaries for e in s.errors]
    return "\n".join([*lines, *(["", "errors (samples):", *errors] if errors else [])])
