"""One DP rank of a simulated engine: its KV pool and prefix cache, its side of the transfer, its
KV event feed, its tiered-cache controller (``worker.hicache.controller``, None without tiers),
the request and token counters its load report is made of, and its waiting line for KV pages
(``worker.page_queue``: a prompt that does not fit in the free pages waits there, first come
first served).

``await acquire(...)`` waits in that line for a prompt's pages and ``with leased(...)`` serves
them. A leased prompt's ``Progress`` runs its forward pass in three steps: ``await ready()``
before it queues for the forward pass (the late-prefetch policy), ``await begin()`` when the pass
starts (the prefix served from L2/L3 joins the cached prefix; returns where computing starts and
the layer-by-layer load to wait on), ``computed(end)`` after each chunk. Without tiers the first
two do nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from worker.block_hash import BlockKey
from worker.hicache.controller import CacheController
from worker.hicache.fetch import TierFetch
from worker.hicache.layer_loading import LayerLoad
from worker.kv import KVPool
from worker.kv_events import RankEvents
from worker.metrics import RankSnapshot
from worker.page_queue import PageQueue
from worker.prefill import PrefillScheduler
from worker.prefix_cache import Lease

__all__ = ["AUX_LEN", "AUX_SLOTS", "Progress", "Rank", "RankStats"]

AUX_LEN = 24  # prompt length, room, cached tokens (little-endian uint64 each)
AUX_SLOTS = 256


@dataclass(slots=True)
class RankStats:
    """Counters since start, and requests in flight, of one rank."""

    active: int = 0  # requests being served (non-prefill roles), streaming included
    receiving: int = 0  # decode requests waiting for their KV
    prealloc: int = 0  # decode requests waiting for pages and an aux slot (SGLang's prealloc)
    queued: int = 0  # locally computed requests waiting for pages
    pending_tokens: int = 0  # prompt tokens leased and still to compute
    query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of those, served from it
    computed_tokens: int = 0  # prompt tokens computed here
    received_tokens: int = 0  # prompt tokens whose KV came from a prefill


@dataclass(slots=True)
class Rank:
    """One DP rank: its pool, its side of the transfer, its event feed and its counters."""

    pool: KVPool
    sender: KVSender | None = None
    receiver: KVReceiver | None = None
    scheduler: PrefillScheduler | None = None
    events: RankEvents | None = None
    tiers: CacheController | None = None
    stats: RankStats = field(default_factory=RankStats)
    aux_free: list[int] = field(default_factory=lambda: list(range(AUX_SLOTS)))
    queue: PageQueue = field(default_factory=PageQueue)

    def __post_init__(self) -> None:
        self.pool.cache.on_release = self.queue.notify

    async def acquire(self, tokens: Sequence[int], keys: Sequence[BlockKey]) -> Lease:
        """Pages for a prompt to compute, its cached prefix reused: waits in the rank's line
        until they fit (``WorkerError`` 503 when the line is full or the wait too long). Enter
        ``leased`` with the result at once (no ``await`` in between), or its pages are lost."""
        return await self.queue.take(lambda: self.pool.cache.acquire(tokens, keys))

    @contextlib.contextmanager
    def leased(self, lease: Lease) -> Iterator[Progress]:
        """Serve an ``acquire``d prompt; its pages are released afterwards.

        Counts the prompt's cache query, and its tokens to compute until they are computed.
        """
        tokens = lease.tokens
        progress = Progress(self, lease, lease.cached_tokens)
        self.stats.query_tokens += len(tokens)
        self.stats.hit_tokens += lease.cached_tokens
        self.stats.pending_tokens += len(tokens) - lease.cached_tokens
        try:
            if self.tiers is not None:
                progress.fetch = self.tiers.fetch(lease)
            yield progress
        finally:
            if progress.fetch is not None:
                progress.fetch.close()
            self.stats.pending_tokens -= len(tokens) - progress.done
            self.pool.release(lease.pages)

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Count a decode request as waiting for its KV."""
        self.stats.receiving += 1
        try:
            yield
        finally:
            self.stats.receiving -= 1

    @property
    def _not_running(self) -> int:
        """Requests being served that wait for pages or KV: not running yet."""
        stats = self.stats
        return stats.receiving + stats.prealloc + stats.queued

    def snapshot(self, index: int) -> RankSnapshot:
        """This rank's load and cache counters now (running: in the forward pass, or served
        by a non-prefill role and not waiting for pages or KV)."""
        counts = self.scheduler.counts if self.scheduler is not None else {}
        stats, cache = self.stats, self.pool.cache
        return RankSnapshot(
            rank=index,
            running=counts.get("forward", 0) + max(stats.active - self._not_running, 0),
            waiting=counts.get("waiting", 0) + stats.queued,
            receiving=stats.receiving,
            prealloc=stats.prealloc,
            bootstrap=counts.get("bootstrap", 0),
            inflight=counts.get("inflight", 0),
            used_pages=cache.used_pages,
            total_pages=cache.num_pages,
            page_size=cache.page_size,
            pool_bytes=len(self.pool.data),
            waiting_tokens=stats.pending_tokens,
            query_tokens=stats.query_tokens,
            hit_tokens=stats.hit_tokens,
            computed_tokens=stats.computed_tokens,
            received_tokens=stats.received_tokens,
        )


@dataclass(slots=True)
class Progress:
    """A leased prompt's forward progress: ``computed(end)`` after each chunk counts the new
    tokens and caches the full pages written so far."""

    rank: Rank
    lease: Lease
    done: int  # positions [0, done) have KV
    fetch: TierFetch | None = None  # the prefix beyond L1 (tiers only)

    @property
    def pages(self) -> list[int]:
        return self.lease.pages

    @property
    def cached_tokens(self) -> int:
        return self.lease.cached_tokens

    async def ready(self) -> None:
        """Before queueing for the forward pass: the late-prefetch policy (tiers only)."""
        if self.fetch is not None:
            await self.fetch.ready()

    async def begin(self) -> tuple[int, LayerLoad | None]:
        """At the forward pass: where computing starts, and the load of the tier-served
        prefix to wait on layer by layer (None: nothing to load)."""
        if self.fetch is None:
            return self.done, None
        served, load = await self.fetch.begin()
        stats = self.rank.stats
        stats.hit_tokens += served
        stats.pending_tokens -= served
        self.done += served
        return self.done, load

    def computed(self, end: int) -> None:
        stats = self.rank.stats
        stats.computed_tokens += end - self.done
        stats.pending_tokens -= end - self.done
        self.done = end
        stored = self.rank.pool.cache.commit(self.lease, end)
        if self.rank.tiers is not None:
            self.rank.tiers.committed(self.lease, stored)
