"""``least_load``: the candidate with the lowest load score."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from router.scheduling.policies.base import LoadPolicy
from router.workers import Worker

__all__ = ["LeastLoad"]


class LeastLoad(LoadPolicy):
    """Lowest ``load_score``: the engine's reported load plus this router's dispatches since,
    or this router's in-flight count when the engine's load is unknown. Ties go round-robin."""

    name = "least_load"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        scores = [worker.load_score() for worker in candidates]
        lowest = min(scores)
        tied = [worker for worker, score in zip(candidates, scores, strict=True) if score == lowest]
        return tied[next(self._counter) % len(tied)]
