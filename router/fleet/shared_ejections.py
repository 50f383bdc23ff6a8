"""Outlier ejections shared by the processes of ``router --workers N`` and by router replicas:
a worker that one of them ejects (``router.fleet.outlier``: its legs stopped completing, or
timed out in a row) is ejected by the others too, for the same time, over the host's bus or the
replicas' sync (``router.fleet.verdict_relay``).

Each process judges only the legs it sent: with N processes a frozen prefill piles up about 1/N
of its legs in each, and a run of timeouts is spread over N processes' counts, so alone each
would find it later or never. Shared, the first to find it takes it out of every process's
routing within a millisecond or so (the host) or a network delay (the replicas).

Bounded: a receiver applies its own ejection budget (``max_ejection_percent``, never the last
worker in service), so two processes that each eject a different worker at once cannot empty a
pool between them; a verdict a receiver cannot apply leaves that worker to its own detector and
probes. An ejection is not passed on by those that follow it, and not counted again in
``pdr_outlier_ejections_total`` (the process that found it counts it).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from router.fleet.outlier import OutlierDetector
from router.fleet.verdict_relay import VerdictChannel, relay
from router.workers import Worker

__all__ = ["EjectionVerdict", "share_ejections"]


class EjectionVerdict(msgspec.Struct, array_like=True, tag="ejection"):
    worker_id: str
    ejection_s: float  # how long it stays out from the verdict on, at least
    reason: str


def share_ejections(
    detector: OutlierDetector,
    lookup: Callable[[str], Worker | None],
    *,
    host: VerdictChannel | None = None,
    fleet: VerdictChannel | None = None,
) -> None:
    """Tell this process's ejections to its siblings (``host``) and to the replica peers
    (``fleet``), and follow theirs (``OutlierDetector.adopt``)."""

    def follow(verdict: EjectionVerdict) -> None:
        worker = lookup(verdict.worker_id)
        if worker is not None:
            detector.adopt(worker, verdict.ejection_s, verdict.reason)

    tell = relay(EjectionVerdict, follow, host=host, fleet=fleet)

    def tell_ejection(worker: Worker, reason: str) -> None:
        tell(EjectionVerdict(worker.id, detector.ejection_s, reason))

    detector.on_verdict = tell_ejection
