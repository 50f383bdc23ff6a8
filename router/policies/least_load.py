from __future__ import annotations

import itertools
from collections.abc import Sequence

from router.workers import Worker

__all__ = ["LeastLoad"]


class LeastLoad:
    """Fewest in-flight requests at this router; ties are broken round-robin."""

    name = "least_load"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        size = len(candidates)
        start = next(self._counter) % size
        best = candidates[start]
        for offset in range(1, size):
            worker = candidates[(start + offset) % size]
            if worker.inflight < best.inflight:
                best = worker
        return best
