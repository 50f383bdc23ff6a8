"""Explicit routing states per prefill DP rank and per pool: EXACT, DEGRADED, FALLBACK.

- ``fallback``: the rank is routed on the approximate prefix tree or on load only: the prefill
  policy does not predict the cache, no token ids (no ``--tokenizer`` / ``--render-url``), no KV
  event stream, or no event received yet;
- ``degraded``: events are followed but cannot be trusted now: the rank's index was purged
  (batches lost once followed, a failed subscription) or its publisher restarted within
  ``events_stale_s``; the engine computed prompt
  tokens (its answers or its counters say) more than ``events_stale_s`` after the last batch,
  and none came in the ``GRACE_S`` since (a silent stream); or the
  rank's recent predictions are off (``agreement_tolerance``, over at least
  ``agreement_min_requests`` reported requests);
- ``exact``: events flowing and predictions agreeing (or too few requests yet to say).

A pool (a served model name; ``default`` for prefills naming none) is ``degraded`` when one of
its ranks is, else ``fallback`` when one is, else ``exact``. ``evaluate`` runs every ``poll_s``
(a lifespan task); each transition is logged once with its reason and counted
(``pdr_routing_state_transitions_total``); the last evaluation is what ``/ready``, the status
page, ``pdr_routing_state`` and the doctor read. Each process of ``router --workers N`` judges
from its own requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from router.fleet.engine_cache import EngineCache
from router.kv_cache.event_feed import FeedStats, KVEventFeed
from router.kv_cache.index import KVBlockIndex
from router.observability.agreement import DEFAULT_BLOCK_TOKENS, AgreementBoard, AgreementSummary
from router.settings import ObservabilitySettings, RouterSettings
from router.workers import Worker

__all__ = ["DEFAULT_POOL", "RankState", "RoutingInputs", "RoutingState", "RoutingStates"]
__all__ += ["GAPPED", "SILENT", "predicts_cache", "routing_states"]

logger = logging.getLogger(__name__)

DEFAULT_POOL = "default"  # the pool of prefills that name no model
POLL_S = 1.0
GAPPED = "KV events gapped"  # how the reasons of the feed's two troubles begin
SILENT = "KV events silent"
GRACE_S = 2.0  # after an answer, how long its blocks' event batch may take to arrive
_SEVERITY = {"exact": 0, "fallback": 1, "degraded": 2}


class RoutingState(StrEnum):
    EXACT = "exact"
    DEGRADED = "degraded"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class RankState:
    """One prefill rank's state, why, and the agreement window it was judged on."""

    worker: str  # the public URL
    worker_id: str
    dp_rank: int
    state: RoutingState
    reason: str
    models: frozenset[str]
    agreement: AgreementSummary | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "dp_rank": self.dp_rank,
            "state": self.state.value,
            "reason": self.reason,
        }


class FeedEvidence(Protocol):
    """What the states read of the KV event feed (``KVEventFeed.evidence``)."""

    def evidence(self, location: tuple[str, int]) -> FeedStats | None: ...


class EngineCacheView(Protocol):
    """The engines' own prefix-cache counters (``router.fleet.engine_cache.EngineCaches``)."""

    def get(self, location: tuple[str, int]) -> EngineCache | None: ...


@dataclass(frozen=True, slots=True)
class RoutingInputs:
    """What the states are judged from, besides the settings."""

    prefills: Callable[[], list[Worker]]
    feed: FeedEvidence
    index: KVBlockIndex
    board: AgreementBoard
    predicts: bool  # the prefill policy predicts the cache (cache_aware)
    tokenizes: bool  # the router has the prompts' token ids (--tokenizer, --render-url)
    caches: EngineCacheView | None = None  # the engines' counters (None: not read)


class RoutingStates:
    def __init__(
        self,
        inputs: RoutingInputs,
        settings: ObservabilitySettings,
        on_transition: Callable[[str, str], None] | None = None,
        *,
        poll_s: float = POLL_S,
    ) -> None:
        """``on_transition(scope, state)``: counts each transition (scope ``rank``, ``pool``)."""
        self.inputs = inputs
        self.settings = settings
        self._on_transition = on_transition
        self.poll_s = poll_s
        self.ranks: dict[tuple[str, int], RankState] = {}
        self.pools: dict[str, tuple[RoutingState, str]] = {}
        # per location: the feed's trouble count (lost + restarts + purges) and when it moved
        self._trouble: dict[tuple[str, int], tuple[int, float]] = {}

    async def run(self) -> None:
        while True:
            self.evaluate()
            await asyncio.sleep(self.poll_s)

    def evaluate(self, now: float | None = None) -> None:
        """Judge every routable prefill rank and pool now; log and count the transitions."""
        now = time.monotonic() if now is None else now
        ranks: dict[tuple[str, int], RankState] = {}
        for worker in self.inputs.prefills():
            if not worker.healthy or worker.draining:
                continue
            for rank in range(max(worker.dp_size, 1)):
                ranks[(worker.id, rank)] = self._judge(worker, rank, now)
        for key, judged in ranks.items():
            old = self.ranks.get(key)
            if old is None or old.state is not judged.state:
                self._transition("rank", f"prefill {judged.worker} rank {judged.dp_rank}",
                                 None if old is None else old.state, judged)  # fmt: skip
        self.ranks = ranks
        self._trouble = {key: value for key, value in self._trouble.items() if key in ranks}
        pools = _pools(ranks.values())
        for name, (state, reason) in pools.items():
            old_pool = self.pools.get(name)
            if old_pool is None or old_pool[0] is not state:
                prior = None if old_pool is None else old_pool[0]
                self._log("pool", f"pool {name}", prior, state, reason)
        self.pools = pools

    def _transition(
        self, scope: str, what: str, old: RoutingState | None, judged: RankState
    ) -> None:
        self._log(scope, what, old, judged.state, judged.reason)

    def _log(
        self, scope: str, what: str, old: RoutingState | None, new: RoutingState, reason: str
    ) -> None:
        if old is None and new is RoutingState.EXACT:
            return  # a rank or pool that starts well is no news
        level = logging.WARNING if new is RoutingState.DEGRADED else logging.INFO
        was = "new" if old is None else old.value
        logger.log(level, "routing state of %s: %s -> %s: %s", what, was, new.value, reason)
        if self._on_transition is not None:
            self._on_transition(scope, new.value)

    def _judge(self, worker: Worker, rank: int, now: float) -> RankState:
        state, reason, summary = self._state_of(worker, rank, now)
        return RankState(worker.public_url, worker.id, rank, state, reason, worker.models, summary)

    def _state_of(
        self, worker: Worker, rank: int, now: float
    ) -> tuple[RoutingState, str, AgreementSummary | None]:
        inputs, settings = self.inputs, self.settings
        location = (worker.id, rank)
        summary = self.summary(location)
        if not inputs.predicts:
            return RoutingState.FALLBACK, "the prefill policy routes on load only", summary
        if not inputs.tokenizes:
            why = "no token ids (--tokenizer, --render-url): routing on the approximate prefix tree"
            return RoutingState.FALLBACK, why, summary
        stats = inputs.feed.evidence(location)
        if stats is None:
            why = "no KV event stream: routing on the approximate prefix tree"
            return RoutingState.FALLBACK, why, summary
        if stats.last_batch_at is None:
            why = "no KV event received yet: routing on the approximate prefix tree"
            return RoutingState.FALLBACK, why, summary
        # the index could not be trusted (a purge: batches lost after the start, a failed
        # subscription) or the publisher started over; a new subscription counts from 0 again
        trouble = stats.restarts + stats.purges
        seen = self._trouble.get(location)
        if seen is None or trouble < seen[0]:
            self._trouble[location] = seen = (trouble, -1e18 if seen is None else seen[1])
        elif trouble > seen[0]:
            self._trouble[location] = seen = (trouble, now)
        stale_s = settings.events_stale_s
        if now - seen[1] < stale_s:
            why = (
                f"{GAPPED} {now - seen[1]:.0f}s ago (lost {stats.lost}, publisher "
                f"restarts {stats.restarts}, index purges {stats.purges} so far)"
            )
            return RoutingState.DEGRADED, why, summary
        computed = self.computed_at(location)
        last = stats.last_batch_at
        # its blocks' batch comes just before or after an answer: none within stale_s of it
        if computed is not None and computed - last > stale_s and now - computed >= GRACE_S:
            why = (
                f"{SILENT}: the engine computed prompt tokens {now - computed:.0f}s ago, the "
                f"last event batch came {now - last:.0f}s ago"
            )
            return RoutingState.DEGRADED, why, summary
        return self._by_agreement(summary)

    def _by_agreement(
        self, summary: AgreementSummary | None
    ) -> tuple[RoutingState, str, AgreementSummary | None]:
        tolerance = self.settings.agreement_tolerance
        if summary is None or summary.reported < self.settings.agreement_min_requests:
            return RoutingState.EXACT, "KV events flowing; too few requests to compare", summary
        error = summary.error_ratio or 0.0
        told = f"{error:.1%} of the prompt over {summary.reported} requests"
        if error > tolerance:
            why = f"predictions off: mean error {told} (tolerance {tolerance:.0%})"
            return RoutingState.DEGRADED, why, summary
        return RoutingState.EXACT, f"KV events flowing; predictions agree: error {told}", summary

    def computed_at(self, location: tuple[str, int]) -> float | None:
        """When the engine last computed prompt tokens (stored new blocks): its answers' word
        or its own counters', the later; None: not known."""
        agreement = self.inputs.board.get(location)
        caches = self.inputs.caches
        cache = None if caches is None else caches.get(location)
        times = [
            at
            for at in (
                None if agreement is None else agreement.last_computed_at,
                None if cache is None else cache.last_computed_at,
            )
            if at is not None
        ]
        return max(times) if times else None

    def engine_cache(self, location: tuple[str, int]) -> EngineCache | None:
        caches = self.inputs.caches
        return None if caches is None else caches.get(location)

    def summary(self, location: tuple[str, int]) -> AgreementSummary | None:
        agreement = self.inputs.board.get(location)
        if agreement is None:
            return None
        size = self.block_size(location) or DEFAULT_BLOCK_TOKENS
        return agreement.summary(self.settings.agreement_tolerance, size)

    def block_size(self, location: tuple[str, int]) -> int | None:
        """The rank's block size: its events', else the configured one."""
        return self.inputs.index.block_size_of(location) or self.settings.engine_block_size

    def describe(self) -> dict[str, Any]:
        """The last evaluation: each rank's and each pool's state with its reason."""
        return {
            "ranks": [judged.as_dict() for judged in self.ranks.values()],
            "pools": [
                {"pool": name, "state": state.value, "reason": reason}
                for name, (state, reason) in sorted(self.pools.items())
            ],
        }


def _pools(ranks: Any) -> dict[str, tuple[RoutingState, str]]:
    """Each pool's worst rank state, and why (the worst rank's reason)."""
    worst: dict[str, RankState] = {}
    for judged in ranks:
        for name in judged.models or (DEFAULT_POOL,):
            found = worst.get(name)
            if found is None or _SEVERITY[judged.state] > _SEVERITY[found.state]:
                worst[name] = judged
    return {
        name: (judged.state, f"prefill {judged.worker} rank {judged.dp_rank}: {judged.reason}")
        for name, judged in worst.items()
    }


def routing_states(
    settings: RouterSettings,
    prefills: Callable[[], list[Worker]],
    feed: KVEventFeed,
    index: KVBlockIndex,
    board: AgreementBoard,
    on_transition: Callable[[str, str], None],
    caches: EngineCacheView | None = None,
) -> RoutingStates:
    """The router's routing states, judged from its settings' policy and token source."""
    predicts = predicts_cache(settings)
    cache = settings.cache
    tokenizes = bool(
        cache.tokenizer or cache.render_url or cache.model_tokenizers or cache.model_render_urls
    )
    inputs = RoutingInputs(prefills, feed, index, board, predicts, tokenizes, caches)
    return RoutingStates(inputs, settings.observability, on_transition)


def predicts_cache(settings: RouterSettings) -> bool:
    """Whether the prefill policy predicts the cache (``cache_aware``), the fleet's or a
    model's (``--model-policy``)."""
    policy = settings.policy
    own = policy.model_policies.values()
    return (policy.prefill_policy or policy.policy) == "cache_aware" or "cache_aware" in own
