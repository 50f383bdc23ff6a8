"""Circuit breaker verdicts shared by the processes of ``router --workers N`` and by router
replicas: when a worker's or a pair's breaker opens or closes in one, the others' follow
(``Circuits.adopt``), over the host's bus (``router.sibling_bus``) or the replicas' sync
(``router.fleet.replica_sync``).

Bounded: a verdict reaches the siblings within a millisecond or so; until then they may send
the target a request or two more. Each process still runs its own half-open trial once its
back-off is over, so a target that came back gets at most one trial request per process (N,
not 1) before every process has closed its breaker again.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from router.fleet.circuit_breaker import Circuits
from router.fleet.verdict_relay import VerdictChannel, relay
from router.workers import Worker

__all__ = ["BreakerVerdict", "share_breakers"]


class BreakerVerdict(msgspec.Struct, array_like=True, tag="breaker"):
    ids: list[str]  # a worker's id, or a pair's prefill and decode ids
    opened: bool
    open_s: float
    reason: str


def share_breakers(
    circuits: Circuits,
    lookup: Callable[[str], Worker | None],
    *,
    host: VerdictChannel | None = None,
    fleet: VerdictChannel | None = None,
) -> None:
    """Tell this process's verdicts to its siblings (``host``: the bus of ``router --workers
    N``) and to the replica peers (``fleet``: the replicas' sync), and follow theirs
    (``router.fleet.verdict_relay``)."""

    def follow(verdict: BreakerVerdict) -> None:
        workers = [lookup(worker_id) for worker_id in verdict.ids]
        known = tuple(worker for worker in workers if worker is not None)
        if len(known) == len(workers) and 1 <= len(known) <= 2:
            circuits.adopt(known, verdict.opened, verdict.open_s, verdict.reason)

    tell = relay(BreakerVerdict, follow, host=host, fleet=fleet)

    def tell_verdict(key: tuple[str, ...], opened: bool, open_s: float, reason: str) -> None:
        tell(BreakerVerdict(list(key), opened, open_s, reason))

    circuits.on_verdict = tell_verdict
