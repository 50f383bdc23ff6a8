"""``Worker.load``'s block: one leg's in-flight, pending-token and dispatch counts at a worker
(and, with ``router --workers N``, on the host's load board) while the leg runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from router.leg_stats import LegStats
from router.load_board import DISPATCHED, LEGS, TOKENS, HostLoad

__all__ = ["LegLoad"]


class _Counted(Protocol):
    """What a leg counts at (``router.workers.Worker``)."""

    inflight: int
    rank_inflight: list[int]
    rank_dispatched: list[int]
    rank_pending_tokens: list[int]
    host_load: HostLoad | None
    legs: LegStats
    leg_ended: Callable[[], None] | None


class LegLoad:
    """``Worker.load``'s block (a plain class: no generator per leg)."""

    __slots__ = ("_host", "_leg", "_pending", "_ranks", "_slot", "rank", "tokens", "worker")

    def __init__(self, worker: _Counted, rank: int, tokens: int) -> None:
        self.worker = worker
        self.rank = rank
        self.tokens = tokens
        self._ranks: list[int] | None = None
        self._pending: list[int] = []
        self._leg = 0
        self._host: HostLoad | None = None
        self._slot = 0

    def __enter__(self) -> None:
        worker, rank = self.worker, self.rank
        worker.inflight += 1
        ranks = worker.rank_inflight
        if rank < len(ranks):
            # kept: a layout change replaces the lists, the leg leaves the ones it entered
            self._ranks, self._pending = ranks, worker.rank_pending_tokens
            ranks[rank] += 1
            worker.rank_dispatched[rank] += 1
            self._pending[rank] += self.tokens
            host = worker.host_load
            if host is not None and rank < len(host.slots):
                slot = host.slots[rank]
                if slot is not None:
                    self._host, self._slot = host, slot
                    host.add(slot, LEGS, 1)
                    host.add(slot, TOKENS, self.tokens)
                    host.add(slot, DISPATCHED, 1)
        self._leg = worker.legs.begin()

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        worker, rank, ranks = self.worker, self.rank, self._ranks
        worker.legs.end(self._leg, completed=exc_type is None)
        worker.inflight -= 1
        if ranks is not None:
            ranks[rank] -= 1
            self._pending[rank] -= self.tokens
            if self._host is not None:
                self._host.add(self._slot, LEGS, -1)
                self._host.add(self._slot, TOKENS, -self.tokens)
        if worker.leg_ended is not None:  # --queue-at-worker-caps: a place came free
            worker.leg_ended()
