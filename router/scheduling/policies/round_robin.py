"""``round_robin``: the candidates in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from router.scheduling.policies.base import LoadPolicy
from router.workers import Worker

__all__ = ["RoundRobin"]


class RoundRobin(LoadPolicy):
    """Cycles through the candidates in order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        return candidates[next(self._counter) % len(candidates)]
