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
        lowest = min(worker.inflight for worker in candidates)
        tied = [worker for worker in candidates if worker.inflight == lowest]
        return tied[next(self._counter) % len(tied)]
