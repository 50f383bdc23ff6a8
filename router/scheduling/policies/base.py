"""What a policy is: it chooses among candidates and does nothing else (no I/O, no HTTP)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.workers import Worker

__all__ = ["Policy", "least_loaded_rank"]


class Policy(Protocol):
    """Chooses one worker from a non-empty list of available candidates."""

    name: str

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        """Return one of ``candidates`` (never empty). Must not block or raise."""
        ...


def least_loaded_rank(worker: Worker) -> int:
    """The DP rank of ``worker`` with the lowest ``load_score`` (the engine's report plus this
    router's dispatches since, else its in-flight requests); ties go round-robin on the worker's
    own cursor (a cursor shared by all prefills aliases with a round-robin over them: with two
    prefills, each would only ever see even or only odd turns)."""
    loads = [worker.load_score(rank) for rank in range(len(worker.rank_inflight))]
    lowest = min(loads)
    tied = [rank for rank, load in enumerate(loads) if load == lowest]
    turn, worker.rank_turn = worker.rank_turn, worker.rank_turn + 1
    return tied[turn % len(tied)]
