"""Follows every prefill DP rank's KV cache event stream into the router's block index.

One :class:`transfer.events.KVEventSubscriber` (one task) per prefill DP rank whose endpoint is
known: ``Worker.kv_events`` (rank r at port + r), else ``kv_events_port`` on the worker's host;
replay likewise. A lifespan task reconciles the subscriptions with the pool every ``poll_s``:
prefills added or removed, DP size changes, restarts (``epoch`` or engine ids change),
draining and health. ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` are applied at
(worker id, DP rank): the batch's own rank when it names a valid one, else the subscription's,
in the cache tier the event's ``medium`` names (``router.kv_tiers``: GPU, host, disk).

The index must never claim blocks an engine no longer holds, so a location is purged when it
cannot be trusted: the publisher restarted (its seq went back), batches were lost after the
stream was followed (a gap replay could not fill), the subscription failed and is re-opened,
the worker restarted, drains, becomes unhealthy or leaves (then the approximate prefix tree
forgets it too). A new subscription replays the publisher's buffer from seq 0, so a router that
starts after its engines still learns what they hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq

from router.kv_cache.index import KVBlockIndex, Location
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.kv_tiers import tier_of_medium
from router.settings import CacheAwareSettings
from router.workers import Worker, format_host
from transfer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    KVEventSubscriber,
    ReceivedBatch,
    SubscriberStats,
)

__all__ = ["FeedStats", "KVEventFeed", "rank_endpoint"]

logger = logging.getLogger(__name__)

POLL_S = 0.5
RETRY_S = 1.0  # after a subscription failed, before it is re-opened


def rank_endpoint(base: str, rank: int) -> str:
    """``tcp://host:port`` of DP rank ``rank`` given rank 0's endpoint (port + rank)."""
    url = httpx.URL(base)
    if url.port is None:
        raise ValueError(f"a KV event endpoint needs a port: {base!r}")
    return f"tcp://{format_host(url.host)}:{url.port + rank}"


@dataclass(slots=True)
class FeedStats:
    """One location's stream since the router started following it."""

    endpoint: str
    replay_endpoint: str | None
    batches: int = 0  # live batches applied
    replayed: int = 0  # batches applied from replay
    lost: int = 0  # batches the publisher sent that never arrived
    restarts: int = 0  # times the publisher started over (seq went back)
    purges: int = 0  # times the location was cleared because it could not be trusted
    last_batch_at: float | None = None  # time.monotonic() of the last batch applied

    def as_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "batches": self.batches,
            "replayed": self.replayed,
            "lost": self.lost,
            "restarts": self.restarts,
            "purges": self.purges,
        }


@dataclass(slots=True)
class _Follow:
    """One subscription: a location, its endpoints and the task reading them."""

    location: Location
    dp_size: int
    stats: FeedStats
    task: asyncio.Task[None] | None = None
    # the current subscriber's counters, and how much of them is already accounted for
    seen: SubscriberStats = field(default_factory=SubscriberStats)
    seen_lost: int = 0
    seen_restarts: int = 0
    started: bool = False  # a batch was applied since the current subscriber opened

    def opened(self, seen: SubscriberStats) -> None:
        self.seen, self.seen_lost, self.seen_restarts, self.started = seen, 0, 0, False

    @property
    def key(self) -> tuple[str, str | None, int]:
        return self.stats.endpoint, self.stats.replay_endpoint, self.dp_size


class KVEventFeed:
    """Owns the subscriptions; run :meth:`run` as a lifespan task, :meth:`aclose` on exit."""

    def __init__(
        self,
        prefills: Callable[[], list[Worker]],
        index: KVBlockIndex,
        tree: ApproxPrefixTree,
        settings: CacheAwareSettings,
        *,
        poll_s: float = POLL_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self._prefills = prefills
        self._index = index
        self._tree = tree
        self._settings = settings
        self._poll_s = poll_s
        self._retry_s = retry_s
        self._follows: dict[Location, _Follow] = {}
        self._identity: dict[str, tuple[int, tuple[str, ...]]] = {}  # worker id -> epoch, ids
        self._live: set[str] = set()  # routable prefills (healthy, not draining)

    def stats(self, location: Location) -> dict[str, Any] | None:
        """The stream's counters for a location, None when it is not followed."""
        follow = self._follows.get(location)
        return None if follow is None else follow.stats.as_dict()

    def evidence(self, location: Location) -> FeedStats | None:
        """The stream's own counters and last batch time (None: not followed); read only."""
        follow = self._follows.get(location)
        return None if follow is None else follow.stats

    async def run(self) -> None:
        """Reconcile with the pool forever."""
        while True:
            self.reconcile()
            await asyncio.sleep(self._poll_s)

    async def aclose(self) -> None:
        tasks = [f.task for f in self._follows.values() if f.task is not None]
        self._follows.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def reconcile(self) -> None:
        """Bring the subscriptions and the index in line with the pool's prefills now."""
        workers = {worker.id: worker for worker in self._prefills()}
        for wid in list(self._identity):
            if wid not in workers:
                self._purge_worker(wid, "it left the pool")
                del self._identity[wid]
        for worker in workers.values():
            self._check_worker(worker)
        wanted = {
            location: key
            for worker in workers.values()
            if worker.id in self._live
            for location, key in self._endpoints(worker).items()
        }
        for location, follow in list(self._follows.items()):
            if wanted.get(location) != follow.key:
                self._stop(location)
        for location, key in wanted.items():
            if location not in self._follows:
                self._start(location, *key)

    def _check_worker(self, worker: Worker) -> None:
        """Purge a worker that restarted, or that stopped being routable."""
        identity = (worker.epoch, worker.engine_ids)
        old = self._identity.get(worker.id)
        self._identity[worker.id] = identity
        restarted = old is not None and (
            old[0] != identity[0] or (bool(old[1]) and bool(identity[1]) and old[1] != identity[1])
        )
        if restarted:
            self._purge_worker(worker.id, "it restarted")
            for location in [loc for loc in self._follows if loc[0] == worker.id]:
                self._stop(location)
        live = worker.healthy and not worker.draining
        if live:
            self._live.add(worker.id)
        elif worker.id in self._live:
            self._live.discard(worker.id)
            self._purge_worker(worker.id, "it is draining" if worker.draining else "it is down")

    def _purge_worker(self, wid: str, reason: str) -> None:
        logger.info("KV index: forgetting prefill %s: %s", wid, reason)
        self._live.discard(wid)
        self._index.clear_worker(wid)
        self._tree.remove_worker(wid)

    def _endpoints(self, worker: Worker) -> dict[Location, tuple[str, str | None, int]]:
        """Each DP rank's (live endpoint, replay endpoint, DP size); empty when unknown."""
        live, replay = worker.kv_events, worker.kv_events_replay
        settings = self._settings
        if live is None and settings.kv_events_port is not None:
            live = f"tcp://{worker.host}:{settings.kv_events_port}"
        if replay is None and settings.kv_events_replay_port is not None:
            replay = f"tcp://{worker.host}:{settings.kv_events_replay_port}"
        if live is None:
            return {}
        return {
            (worker.id, rank): (
                rank_endpoint(live, rank),
                None if replay is None else rank_endpoint(replay, rank),
                worker.dp_size,
            )
            for rank in range(max(worker.dp_size, 1))
        }

    def _start(self, location: Location, endpoint: str, replay: str | None, dp_size: int) -> None:
        follow = _Follow(location, dp_size, FeedStats(endpoint, replay))
        follow.task = asyncio.create_task(self._follow(follow), name=f"kv-events {location}")
        self._follows[location] = follow
        logger.info("KV events: following %s rank %d at %s", location[0], location[1], endpoint)

    def _stop(self, location: Location) -> None:
        follow = self._follows.pop(location)
        if follow.task is not None:
            follow.task.cancel()
        self._index.clear(location)

    async def _follow(self, follow: _Follow) -> None:
        """Read one stream until cancelled; a failed subscription is purged and re-opened."""
        stats = follow.stats
        while True:
            try:
                async with KVEventSubscriber(
                    stats.endpoint, replay_endpoint=stats.replay_endpoint, start_seq=0
                ) as subscriber:
                    follow.opened(subscriber.stats)
                    if stats.replay_endpoint is not None:
                        await subscriber.catch_up()  # what the engine published before we came
                    async for item in subscriber:
                        self._on_batch(follow, item)
            except (KVEventError, zmq.ZMQError) as exc:
                logger.warning("KV events from %s failed, re-subscribing: %s", stats.endpoint, exc)
            self._purge(follow, "its subscription was re-opened")
            await asyncio.sleep(self._retry_s)

    def _on_batch(self, follow: _Follow, item: ReceivedBatch) -> None:
        stats, seen = follow.stats, follow.seen
        if seen.restarts > follow.seen_restarts:
            stats.restarts += seen.restarts - follow.seen_restarts
            follow.seen_restarts = seen.restarts
            self._purge(follow, "its publisher restarted")
        if seen.lost > follow.seen_lost:
            lost, follow.seen_lost = seen.lost - follow.seen_lost, seen.lost
            stats.lost += lost
            if follow.started:  # a gap before the first batch only hides older blocks
                self._purge(follow, f"{lost} event batch(es) were lost")
        follow.started = True
        stats.last_batch_at = time.monotonic()
        if item.replayed:
            stats.replayed += 1
        else:
            stats.batches += 1
        location = self._batch_location(follow, item.batch.data_parallel_rank)
        for event in item.batch.events:
            self._apply(location, event)

    def _batch_location(self, follow: _Follow, rank: int | None) -> Location:
        if rank is not None and 0 <= rank < follow.dp_size:
            return (follow.location[0], rank)
        return follow.location

    def _apply(self, location: Location, event: Any) -> None:
        """One event at ``location``, in the tier its ``medium`` names (events for a medium
        without a tier, e.g. ``EXTERNAL``, are skipped); ``AllBlocksCleared`` clears every
        tier."""
        if isinstance(event, BlockStored):
            tier = tier_of_medium(event.medium)
            if tier is not None:
                self._index.apply_stored(
                    location,
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    tier,
                    event.lora_name,
                )
        elif isinstance(event, BlockRemoved):
            tier = tier_of_medium(event.medium)
            if tier is not None:
                self._index.apply_removed(location, event.block_hashes, tier)
        elif isinstance(event, AllBlocksCleared):
            self._index.clear(location)

    def _purge(self, follow: _Follow, reason: str) -> None:
        logger.warning("KV index: clearing %s rank %d: %s", *follow.location, reason)
        follow.stats.purges += 1
        self._index.clear(follow.location)
