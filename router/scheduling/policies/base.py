"""What a policy is: it chooses among candidates and does nothing else (no I/O, no HTTP).

Every policy chooses a worker (``choose``: the decode side) and a prefill with its DP rank
(``choose_prefill``: the prefill side, from the request's features). A load policy (round-robin,
least-load, power-of-two: :class:`LoadPolicy`) reads no features and predicts no cached prompt
tokens; ``cache_aware`` reads them and predicts what the chosen rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.scheduling.features import RequestFeatures
from router.workers import Worker

__all__ = ["LOAD", "LoadPolicy", "Policy", "PrefillChoice", "least_loaded_rank"]

LOAD = "load"


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """The chosen prefill and DP rank, how they were chosen, and the prompt tokens predicted to
    be cached there (0 when unknown; precise: credited by cache tier). ``predicted``: whether
    the policy predicts the cache at all (cache_aware); a load policy does not."""

    worker: Worker
    rank: int
    # cache_aware: "precise" | "approximate" | "load" (imbalance, or too little cached to
    # decide); a load policy: its name
    how: str
    cached_tokens: int = 0
    mode: str = LOAD  # how the cache was judged: what ``CacheAware.record`` remembers
    predicted: bool = False


class Policy(Protocol):
    """Chooses one worker, or one prefill and DP rank, from a non-empty list of available
    candidates."""

    name: str
    reads_features: bool  # whether ``choose_prefill`` reads the prompt's text or size
    reads_tokens: bool  # whether it reads the prompt's token ids too

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        """Return one of ``candidates`` (never empty). Must not block or raise."""
        ...

    def choose_prefill(
        self, candidates: Sequence[Worker], features: RequestFeatures
    ) -> PrefillChoice:
        """The prefill and DP rank for a request among ``candidates`` (never empty)."""
        ...

    def scores(
        self, candidates: Sequence[Worker], features: RequestFeatures
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """How the cache is judged (None: not at all) and, per prefill and DP rank, what
        ``choose_prefill`` weighs. Reads only (``POST /admin/explain``)."""
        ...

    def record(self, choice: PrefillChoice, features: RequestFeatures) -> None:
        """The request goes to ``choice`` (its prefill leg is sent): remember what matters for
        the requests that follow."""
        ...


class LoadPolicy:
    """The prefill side of a policy that weighs load only: the worker ``choose`` picks, at its
    least loaded DP rank; no features read, no cache predicted, nothing recorded."""

    name: str
    reads_features = False
    reads_tokens = False

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        raise NotImplementedError

    def choose_prefill(
        self, candidates: Sequence[Worker], features: RequestFeatures
    ) -> PrefillChoice:
        prefill = self.choose(candidates)
        rank = least_loaded_rank(prefill) if prefill.dp_size > 1 else 0
        return PrefillChoice(prefill, rank, self.name)

    def scores(
        self, candidates: Sequence[Worker], features: RequestFeatures
    ) -> tuple[str | None, list[dict[str, Any]]]:
        return None, [
            {
                "worker": worker.public_url,
                "dp_rank": rank,
                "load": worker.load_score(rank),
                "pending_prefill_tokens": worker.pending_tokens(rank),
                "predicted_cached_tokens": None,  # only cache_aware predicts
            }
            for worker in candidates
            for rank in range(max(worker.dp_size, 1))
        ]

    def record(self, choice: PrefillChoice, features: RequestFeatures) -> None:
        return None


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
