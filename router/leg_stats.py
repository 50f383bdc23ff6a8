"""The timestamps one worker's legs leave for outlier detection (``router.fleet.outlier``)."""

from __future__ import annotations

import time

__all__ = ["LegStats"]


class LegStats:
    """What the request path leaves for outlier detection (``router.fleet.outlier``), at the
    cost of two clock reads per leg: when each leg in flight started (in start order, so the
    first is the oldest), when a leg last completed, a moving average of completed legs'
    latency, and the legs in a row that timed out."""

    __slots__ = ("_next", "last_completed", "latency_s", "started", "timeouts_in_row")

    def __init__(self) -> None:
        self._next = 0
        self.started: dict[int, float] = {}  # leg -> time.monotonic() it started
        self.last_completed = -1e18
        self.latency_s = 0.0  # 0: no leg completed yet
        self.timeouts_in_row = 0

    def begin(self) -> int:
        leg = self._next
        self._next = leg + 1
        self.started[leg] = time.monotonic()
        return leg

    def end(self, leg: int, *, completed: bool) -> None:
        """The leg ended: ``completed`` when the engine answered it (not cancelled, failed)."""
        started = self.started.pop(leg)
        if completed:
            self.last_completed = now = time.monotonic()
            took = now - started
            average = self.latency_s
            self.latency_s = (
                took if average == 0.0 else average + _LATENCY_WEIGHT * (took - average)
            )

    def delivered(self) -> None:
        """A leg did its job although it will not complete (its decode got the KV and served
        the client first, so the leg is cancelled): the worker is not stuck."""
        self.last_completed = time.monotonic()

    def oldest_start(self) -> float | None:
        """When the oldest leg in flight started; None when none is."""
        for started in self.started.values():
            return started
        return None


# the weight of the newest leg in the moving average of a worker's leg latency
_LATENCY_WEIGHT = 0.2
