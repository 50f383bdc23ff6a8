"""The targeted rows of the soak's table: what each must show, in numbers, and whether it did.

``check`` gives a fault's ``RowCheck``: its errors after the detection window (None for the rows
without that target: prefill 5xx, decode SIGKILL, etcd stopped, slow decode), what it measured,
a summary for the table's note and what it missed. A row is met when it recovered and missed
nothing. "Until recovery" is the fault's end plus its recovery time (10 s when it did not).

* **frozen prefill (1 of 2)**: the router shows the frozen prefill out of rotation (unhealthy,
  ejected or its breaker open) within ``DETECTION_WINDOW_S`` of the SIGSTOP; 0 failed requests
  among those sent from then until recovery; no decode's own breaker opened meanwhile (one not
  open in the sample before).
* **empty etcd**: 0 failed requests from the outage until ``SETTLE_S`` after recovery; in that
  span every answered sample lists every worker the router listed before, with a prefill and a
  decode in rotation and the router ready (a usable prefill, its layout known, and decode).
* **KV-pool-full burst**: the burst queues instead of being rejected: 0 failed burst requests
  and 0 failed requests of the traffic meanwhile; its waits (latency p50 and max) are shown.
* **attacks** (large bodies, trailer flood, idle keep-alive flood, slowloris): the router's
  peak RSS within the attack's bound (its RSS before + ``--max-body-memory`` for the bodies +
  a slack), ``/health`` on a new connection always 200 within ``HEALTH_BOUND_MS``, 0 failed
  requests of the traffic and of the completions sent on new connections meanwhile, every
  attacking body answered (its own 4xx/429 are fine).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.soak.cluster import Sample
from bench.soak.faults import ATTACKS, FaultRun
from bench.soak.traffic import Outcome

__all__ = ["DETECTION_WINDOW_S", "HEALTH_BOUND_MS", "SETTLE_S", "RowCheck", "check"]

DETECTION_WINDOW_S = 3.0
HEALTH_BOUND_MS = 100.0
SETTLE_S = 3.0
UNRECOVERED_WINDOW_S = 10.0


@dataclass(frozen=True)
class RowCheck:
    errors_after_window: int | None  # None: no such target for this row
    measures: dict[str, float] = field(default_factory=dict)
    summary: str = ""
    misses: list[str] = field(default_factory=list)


def _failed(outcomes: Sequence[Outcome], start: float, until: float) -> list[Outcome]:
    """The failed ones that overlapped [start, until]."""
    return [o for o in outcomes if not o.ok and o.start <= until and o.end >= start]


def _frozen_prefill(
    run: FaultRun, samples: Sequence[Sample], main: Sequence[Outcome], until: float
) -> RowCheck:
    window = run.start + DETECTION_WINDOW_S
    after = [o for o in main if not o.ok and window <= o.start <= until]
    breakers = _opened(samples, run.start, until)
    detection = run.measures.get("detection_s")
    misses = []
    if detection is None:
        misses.append(f"not out of rotation within {run.spec.duration_s:g} s frozen")
    elif detection > DETECTION_WINDOW_S:
        misses.append(f"out of rotation after {detection:.2f} s > {DETECTION_WINDOW_S:g} s")
    if after:
        misses.append(f"{len(after)} failed requests sent after {DETECTION_WINDOW_S:g} s")
    if breakers:
        misses.append(f"decode breakers opened: {', '.join(sorted(breakers))}")
    seen = "never" if detection is None else f"{detection:.2f} s"
    summary = f"out of rotation: {seen}; decode breakers opened: {len(breakers)}"
    measures = {"decode_breakers": float(len(breakers)), **run.measures}
    return RowCheck(len(after), measures, summary, misses)


def _opened(samples: Sequence[Sample], start: float, until: float) -> set[str]:
    """The decodes whose own breaker opened (was not open in the sample before) in the span."""
    opened: set[str] = set()
    before: frozenset[str] = frozenset()
    for sample in samples:
        if sample.t > until:
            break
        if sample.t >= start:
            opened |= sample.decode_breakers - before
        if sample.registry_ok is not None:  # an answered sample
            before = sample.decode_breakers
    return opened


def _routable(sample: Sample) -> bool:
    roles = {role for url, role in sample.roles.items() if url not in sample.out}
    return bool(sample.ready) and roles >= {"prefill", "decode"}


def _empty_etcd(
    run: FaultRun, samples: Sequence[Sample], main: Sequence[Outcome], until: float
) -> RowCheck:
    span_end = until + SETTLE_S
    failed = _failed(main, run.start, span_end)
    before = next((s for s in reversed(samples) if s.t < run.start and s.roles), None)
    listed = set() if before is None else set(before.roles)
    answered = [s for s in samples if run.start <= s.t <= span_end and s.roles]
    fewest = min((len(listed & set(s.roles)) for s in answered), default=0)
    unroutable = sum(1 for s in answered if not _routable(s))
    misses = [f"{len(failed)} failed requests"] if failed else []
    if fewest < len(listed) or not answered:
        misses.append(f"the router listed {fewest} of its {len(listed)} workers at one point")
    if unroutable:
        misses.append(f"{unroutable} samples not ready or without a prefill or decode in rotation")
    summary = (
        f"workers listed throughout: {fewest} of {len(listed)}; unroutable samples: {unroutable}"
    )
    measures = {"workers_listed_min": float(fewest), "unroutable_samples": float(unroutable)}
    return RowCheck(len(failed), measures, summary, misses)


def _kv_burst(run: FaultRun, main: Sequence[Outcome], until: float) -> RowCheck:
    rejected = [o for o in run.outcomes if not o.ok]
    waits = [o.end - o.start for o in run.outcomes] or [0.0]
    failed = _failed(main, run.start, until)
    measures = {
        "burst_rejected": float(len(rejected)),
        "burst_wait_p50_s": round(statistics.median(waits), 2),
        "burst_wait_max_s": round(max(waits), 2),
    }
    misses = [f"{len(rejected)} of the burst rejected"] if rejected else []
    if failed:
        misses.append(f"{len(failed)} failed requests of the traffic during the burst")
    summary = (
        f"rejected {len(rejected)} of {len(run.outcomes)}; wait p50 "
        f"{measures['burst_wait_p50_s']:.2f} s, max {measures['burst_wait_max_s']:.2f} s"
    )
    return RowCheck(len(rejected) + len(failed), measures, summary, misses)


def _attack(run: FaultRun, main: Sequence[Outcome], until: float) -> RowCheck:
    m = run.measures
    failed = _failed(main, run.start, until) + [o for o in run.outcomes if not o.ok]
    misses = []
    if m["rss_peak_mib"] > m["rss_bound_mib"]:
        misses.append(f"peak RSS {m['rss_peak_mib']:.0f} MiB > {m['rss_bound_mib']:.0f} MiB")
    if m["health_max_ms"] > HEALTH_BOUND_MS or m["health_failed"]:
        misses.append(
            f"/health max {m['health_max_ms']:.0f} ms (bound {HEALTH_BOUND_MS:g}), "
            f"{m['health_failed']:g} failed"
        )
    if failed:
        common = Counter(f"{o.status} {o.detail[:80]}" for o in failed).most_common(1)[0]
        misses.append(
            f"{len(failed)} failed requests of the traffic or new connections (commonest: "
            f"{common[1]}x {common[0]})"
        )
    if m.get("attacker_unanswered"):
        misses.append(f"{m['attacker_unanswered']:g} attacking bodies got no answer")
    summary = (
        f"RSS {m['rss_base_mib']:.0f} -> peak {m['rss_peak_mib']:.0f} MiB (bound "
        f"{m['rss_bound_mib']:.0f}); /health max {m['health_max_ms']:.0f} ms of "
        f"{m['health_probes']:g}, {m['health_failed']:g} failed; "
        f"{len(run.outcomes)} new-connection requests"
    )
    return RowCheck(len(failed), dict(m), summary, misses)


def check(
    run: FaultRun, samples: Sequence[Sample], main: Sequence[Outcome], recovery: float | None
) -> RowCheck:
    until = run.end + (UNRECOVERED_WINDOW_S if recovery is None else recovery)
    kind = run.spec.kind
    if kind == "prefill_sigstop":
        return _frozen_prefill(run, samples, main, until)
    if kind == "etcd_empty":
        return _empty_etcd(run, samples, main, until)
    if kind == "kv_burst":
        return _kv_burst(run, main, until)
    if kind in ATTACKS:
        return _attack(run, main, until)
    return RowCheck(None, dict(run.measures))
