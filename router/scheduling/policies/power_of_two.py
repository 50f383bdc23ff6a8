"""``power_of_two``: the less loaded of two random candidates."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.scheduling.policies.base import LoadPolicy
from router.workers import Worker

__all__ = ["PowerOfTwo"]


class PowerOfTwo(LoadPolicy):
    """Two random candidates; the one with the lower ``load_score`` wins (first on a tie)."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return b if b.load_score() < a.load_score() else a
