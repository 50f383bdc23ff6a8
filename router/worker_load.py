"""What the router keeps of a worker's load: the engine's reports, the replica peers' counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["EngineLoad", "FleetCounts", "LoadReading", "format_host"]


def format_host(host: str) -> str:
    """A host as it goes into ``host:port`` strings: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host else host


class FleetCounts(Protocol):
    """The replica peers' counts at the workers (``router.fleet.replica_sync.ReplicaSync``)."""

    def count(self, worker_id: str, rank: int, board_field: int) -> int: ...


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One DP rank's load as its engine reported it: requests running and waiting, and the share
    of its KV cache in use (0..1; None when the engine does not report it)."""

    running: float
    waiting: float
    kv_usage: float | None = None


@dataclass(frozen=True, slots=True)
class LoadReading:
    """An ``EngineLoad`` as the router keeps it: when it was read, until when it counts (later it
    is stale, i.e. unknown) and the rank's dispatch counter then (later dispatches are credited)."""

    load: EngineLoad
    at: float  # time.monotonic() of the read
    fresh_until: float
    dispatched: int
    queued: float  # running + waiting, kept so that load_score adds nothing up
