"""``cache_aware``: send a prompt to the prefill DP rank that already holds most of its prefix.

Two ways to know what a rank holds (docs/concepts/protocols.md 11.2):

* precise: the engines' KV cache events fill a :class:`KVBlockIndex` of chained block keys per
  (worker, DP rank); the request's token ids, chained the same way, are matched against it.
  Used when the request's token ids are known, every candidate has an event stream and one of
  them has reported its block size (sent an event). With a tiered KV cache a rank's cached
  prefix is its leading run of blocks held in any tier, each block credited by the best tier
  holding it (``tier_weights``: a GPU block 1, host memory and disk less, since the engine must
  load them back): the cached tokens below are these credited tokens.
* approximate: an :class:`ApproxPrefixTree` of the request texts this router sent to each rank
  (SGLang router / SMG style); used otherwise.

Each rank costs the prompt tokens it would have to compute: those this router's in-flight
prefill legs there are predicted to compute (``Worker.pending_tokens``, the queue the request
waits behind) plus the request's own uncached tokens there; the cheapest rank wins, ties go to
the lower load, then round-robin. With nothing queued the longest cached prefix wins; a busy
rank holding the prefix loses the request once its queue costs more than computing the whole
prompt elsewhere (Dynamo's KV router weighs the same two terms). A cached prefix counts only
when it covers at least ``cache_threshold`` of the prompt (a shared template header alone must
not pull every request to one rank). When the prompt's size is unknown the longest cached
prefix wins (or, below the threshold, the least loaded rank). When the load over the candidate
ranks is imbalanced, ``(max - min) > balance_abs_threshold`` and
``max > balance_rel_threshold * min`` (``Worker.load_score``, requests), the least loaded rank
wins instead (SMG semantics). Once the pipeline sends the prefill leg it calls ``record`` (predicted
index entries, or the text in the tree) so that the next turn of a conversation follows it even
before the engine's events arrive. Like every policy it only chooses (no I/O): the pipeline
computes the request's features first. As a plain ``Policy`` (the decode side) it is least-load.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.kv_cache.index import KVBlockIndex, Location
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.kv_tiers import TierMatch, TierWeights
from router.scheduling.features import RequestFeatures
from router.scheduling.policies.base import LOAD, PrefillChoice
from router.settings import CacheAwareSettings
from router.workers import Worker

__all__ = ["APPROXIMATE", "LOAD", "PRECISE", "CacheAware", "PrefillChoice"]

PRECISE = "precise"
APPROXIMATE = "approximate"
_NO_MATCH = TierMatch((0, 0, 0))


@dataclass(frozen=True, slots=True)
class _Cached:
    """How the cache was judged and, per place, the prompt tokens predicted cached there
    (precise: credited by tier) and, precise only, the matched blocks per tier."""

    mode: str
    tokens: list[int]
    matches: list[TierMatch] | None = None


def _all_locations(candidates: Sequence[Worker]) -> list[tuple[Worker, int]]:
    return [(worker, rank) for worker in candidates for rank in range(max(worker.dp_size, 1))]


class CacheAware:
    """The ``cache_aware`` prefill policy over a shared index and prefix tree."""

    name = "cache_aware"
    reads_features = True
    reads_tokens = True  # precise matching, when a token source is configured

    def __init__(
        self,
        settings: CacheAwareSettings | None = None,
        *,
        index: KVBlockIndex | None = None,
        tree: ApproxPrefixTree | None = None,
        has_stream: Callable[[Worker], bool] | None = None,
    ) -> None:
        self.settings = settings = settings or CacheAwareSettings()
        self.index = index or KVBlockIndex(settings.max_indexed_blocks, settings.prediction_ttl_s)
        self.tree = tree or ApproxPrefixTree(settings.approx_tree_max_chars)
        self.tier_weights = TierWeights.from_mapping(settings.tier_weights)
        self._has_stream = has_stream or self._configured_stream
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        """As a plain policy (decode side): the lowest load score, ties round-robin."""
        lowest = min(worker.load_score(None) for worker in candidates)
        tied = [worker for worker in candidates if worker.load_score(None) == lowest]
        return tied[next(self._turn) % len(tied)]

    def choose_prefill(
        self, candidates: Sequence[Worker], features: RequestFeatures
    ) -> PrefillChoice:
        """The prefill and DP rank for a request, among available ``candidates`` (non-empty)."""
        places = _all_locations(candidates)
        loads = [worker.load_score(rank) for worker, rank in places]
        judged = self._cached(places, features)
        mode, cached = judged.mode, judged.tokens
        top = max(cached)
        following = self._worth_following(top, features)
        prompt = features.prompt_tokens
        if self._imbalanced(loads):
            best = self._least(range(len(places)), loads)
        elif prompt:
            # the prefill work the request would wait behind plus its own uncached part
            costs = [
                worker.pending_tokens(rank) + prompt - (cached[i] if following else 0)
                for i, (worker, rank) in enumerate(places)
            ]
            lowest = min(costs)
            best = self._least([i for i, cost in enumerate(costs) if cost == lowest], loads)
        elif following:
            best = self._least([i for i, c in enumerate(cached) if c == top], loads)
        else:
            best = self._least(range(len(places)), loads)
        how = mode if following and cached[best] > 0 else LOAD
        worker, rank = places[best]
        return PrefillChoice(worker, rank, how, cached[best], mode, predicted=True)

    def scores(
        self, candidates: Sequence[Worker], features: RequestFeatures
    ) -> tuple[str, list[dict[str, Any]]]:
        """How the cache is judged, and per prefill and DP rank what ``choose_prefill`` weighs:
        load, prefill tokens pending, predicted cached tokens (precise: credited by tier, with
        the matched blocks per tier and their credited worth in blocks) and the cost in tokens
        (None without a prompt size). Reads only (``POST /admin/explain``)."""
        places = _all_locations(candidates)
        judged = self._cached(places, features)
        cached = judged.tokens
        following = self._worth_following(max(cached), features)
        prompt = features.prompt_tokens
        rows = [
            {
                "worker": worker.public_url,
                "dp_rank": rank,
                "load": worker.load_score(rank),
                "pending_prefill_tokens": worker.pending_tokens(rank),
                "predicted_cached_tokens": cached[i],
                "cost_tokens": None
                if not prompt
                else worker.pending_tokens(rank) + prompt - (cached[i] if following else 0),
            }
            for i, (worker, rank) in enumerate(places)
        ]
        if judged.matches is not None:
            for row, match in zip(rows, judged.matches, strict=True):
                row.update(self._tier_view(match))
        return judged.mode, rows

    def record(self, choice: PrefillChoice, features: RequestFeatures) -> None:
        """The request goes to ``choice``: remember what its rank is about to hold, so the
        requests that follow (a conversation's next turn) find it before the engine's events
        confirm it. Not called when the prefill leg is skipped."""
        location = (choice.worker.id, choice.rank)
        text = features.match_text
        if choice.mode == APPROXIMATE and text:
            self.tree.insert(text, location)
        if choice.mode != PRECISE or features.tokens is None:
            return
        size = self.index.block_size_of(location) or self._any_block_size()
        if size is not None:
            self.index.predict(location, features.keys(size), size)

    def forget(self, worker_id: str) -> None:
        """A worker left (removed, drained, dead, restarted): drop all it was thought to hold."""
        self.index.clear_worker(worker_id)
        self.tree.remove_worker(worker_id)

    def _configured_stream(self, worker: Worker) -> bool:
        return worker.kv_events is not None or self.settings.kv_events_port is not None

    def _cached(self, places: list[tuple[Worker, int]], features: RequestFeatures) -> _Cached:
        """How the cache is judged, and each place's predicted cached prompt tokens. Precise
        needs every candidate's event stream and a block size reported by at least one of them
        (before any event there is nothing to chain keys by: the text tree stands in)."""
        if (
            features.tokens is not None
            and all(self._has_stream(w) for w, _ in places)
            and any(self.index.block_size_of((w.id, rank)) for w, rank in places)
        ):
            return self._precise(places, features)
        text = features.match_text
        if text:
            return _Cached(APPROXIMATE, self._approximate(places, text, features))
        return _Cached(LOAD, [0] * len(places))

    def _precise(self, places: list[tuple[Worker, int]], features: RequestFeatures) -> _Cached:
        """Credited cached tokens and tier matches per place from the index. A place whose
        block size is not known yet (only predictions there) is matched at every block size
        seen among the others; the best credited match counts."""
        locations = [(worker.id, rank) for worker, rank in places]
        sizes = {self.index.block_size_of(location) for location in locations}
        best: dict[Location, tuple[float, TierMatch]] = {}
        for size in sizes - {None}:
            assert size is not None
            group = [loc for loc in locations if self.index.block_size_of(loc) in (size, None)]
            keys = features.keys(size)
            for location, match in self.index.match_tiers(keys, size, group).items():
                credited = match.credited(self.tier_weights) * size
                if location not in best or credited > best[location][0]:
                    best[location] = (credited, match)
        found = [best.get(location, (0.0, _NO_MATCH)) for location in locations]
        return _Cached(PRECISE, [round(credited) for credited, _ in found], [m for _, m in found])

    def _tier_view(self, match: TierMatch) -> dict[str, Any]:
        """A place's matched blocks per tier and their credited worth in blocks (explain)."""
        credited = round(match.credited(self.tier_weights), 3)
        return {"cached_blocks_by_tier": match.as_dict(), "credited_blocks": credited}

    def _approximate(
        self, places: list[tuple[Worker, int]], text: str, features: RequestFeatures
    ) -> list[int]:
        matched = self.tree.match(text, [(worker.id, rank) for worker, rank in places])
        tokens = features.prompt_tokens or 0
        return [
            tokens * matched.get((worker.id, rank), 0) // max(len(text), 1)
            for worker, rank in places
        ]

    def _worth_following(self, cached: int, features: RequestFeatures) -> bool:
        """Whether the best cached prefix is a large enough share of the prompt
        (``cache_threshold``) to decide; a short shared header is not."""
        prompt = features.prompt_tokens
        if cached <= 0:
            return False
        return not prompt or cached >= self.settings.cache_threshold * prompt

    def _imbalanced(self, loads: list[float]) -> bool:
        high, low = max(loads), min(loads)
        settings = self.settings
        return (
            high - low > settings.balance_abs_threshold
            and high > settings.balance_rel_threshold * low
        )

    def _least(self, indices: Sequence[int], loads: list[float]) -> int:
        """The index with the lowest load among ``indices``; ties round-robin."""
        lowest = min(loads[i] for i in indices)
        tied = [i for i in indices if loads[i] == lowest]
        return tied[next(self._turn) % len(tied)]

    def _any_block_size(self) -> int | None:
        for location in self.index.locations():
            size = self.index.block_size_of(location)
            if size is not None:
                return size
        return None
