"""One request's prefix beyond L1: its L2 run, its L3 prefetch and its layer-by-layer load.

``CacheController.fetch`` builds a ``TierFetch`` when the request arrives (before it queues for
the forward pass), with the L2 run (pinned) and the L3 run found past the request's L1 hit. When
the L3 run is at least ``prefetch_threshold_tokens`` long a prefetch starts at once: reads from
the store (verified there) through the ``prefetch_rate`` token bucket, ``PREFETCH_DEPTH`` in
flight, the pages entering L2 (pinned for this request) in order.

* ``ready()`` runs when the request is about to queue for the forward pass and applies the late
  prefetch policy, as SGLang's: ``best_effort`` goes on at once (it will use what has arrived
  by the time it reaches the forward pass), ``wait_complete`` waits for the whole prefetch to
  end, ``timeout`` waits until ``prefetch_timeout_s`` after arrival at most;
* ``begin()`` runs when the forward pass starts: it stops the prefetch, verifies the run (L2 run
  then the pages that arrived, in order; the first that fails its check ends the run: the prefix
  from it on is computed, never served), starts the load of the run into the lease's own pages
  and returns the tokens it serves with the ``LayerLoad`` the forward pass waits on, layer by
  layer. It counts each tier's hits and misses;
* ``close()`` (when the request ends) stops whatever still runs and unpins its L2 pages.

Loaded pages become cached L1 pages when the forward pass commits them, like computed ones.

``TierFetch`` sees its rank's tiers through ``RankTiers``, the part of the controller it uses
(``worker.hicache.controller.CacheController`` is one): the controller imports this module, never
the other way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from worker.hicache.config import TierConfig
from worker.hicache.costs import TokenBucket
from worker.hicache.events import CPU_PINNED, DISK, GPU
from worker.hicache.host_pool import HostPage, HostPool
from worker.hicache.layer_loading import LayerLoad
from worker.hicache.metrics import RankTierMetrics
from worker.hicache.storage_tier import StorageTier
from worker.hicache.stores.base import PageCorrupt, StoredPage, StoredPageHeader
from worker.prefix_cache import Lease

__all__ = ["PREFETCH_DEPTH", "RankTiers", "TierFetch"]

logger = logging.getLogger(__name__)

_VERIFY_BATCH = 16  # pages checked between two event-loop yields
PREFETCH_DEPTH = 8  # L3 reads in flight per prefetch (they arrive in order all the same)


class RankTiers(Protocol):
    """What a ``TierFetch`` uses of its rank's tiers (``CacheController`` provides it)."""

    @property
    def config(self) -> TierConfig: ...
    @property
    def page_size(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def host(self) -> HostPool: ...
    @property
    def storage(self) -> StorageTier | None: ...
    @property
    def metrics(self) -> RankTierMetrics: ...
    @property
    def prefetch_limit(self) -> TokenBucket: ...

    def host_insert(self, page: StoredPage) -> HostPage | None:
        """A prefetched page into L2, pinned (None when L2 has no unpinned slot)."""
        ...

    def host_corrupt(self, page: HostPage, error: Exception) -> None:
        """An L2 page failed its check (``HostPool.verify`` removed it)."""
        ...

    def start_load(
        self, pages: list[HostPage], targets: list[int]
    ) -> tuple[LayerLoad, asyncio.Task[None]]:
        """Load verified, pinned L2 ``pages`` into L1 ``targets`` layer by layer."""
        ...


class TierFetch:
    """One request's L2 run and L3 prefetch, then its load into L1 (module docstring)."""

    def __init__(
        self,
        controller: RankTiers,
        lease: Lease,
        host_run: list[HostPage],
        disk_run: list[StoredPageHeader],
    ) -> None:
        self._c = controller
        self._lease = lease
        self._l1_pages = lease.committed
        self._host_run = host_run
        self._disk_run = disk_run
        self._arrived: list[HostPage] = []
        self._pinned: list[HostPage] = list(host_run)
        self._arrival = time.monotonic()
        self._load: asyncio.Task[None] | None = None
        self._prefetch: asyncio.Task[None] | None = None
        config = controller.config
        if disk_run and len(disk_run) * controller.page_size >= config.prefetch_threshold_tokens:
            self._prefetch = asyncio.create_task(self._prefetch_run(), name="l3-prefetch")
            self._prefetch.add_done_callback(_log_crash)

    @property
    def prefetching(self) -> bool:
        """Whether a prefetch was started for this request."""
        return self._prefetch is not None

    async def ready(self) -> None:
        """Apply the late-prefetch policy before the request queues for the forward pass."""
        task = self._prefetch
        if task is None or task.done():
            return
        config = self._c.config
        if config.prefetch_policy == "wait_complete":
            await asyncio.wait({task})
        elif config.prefetch_policy == "timeout":
            left = self._arrival + config.prefetch_timeout_s - time.monotonic()
            if left > 0:
                await asyncio.wait({task}, timeout=left)

    async def begin(self) -> tuple[int, LayerLoad | None]:
        """At the forward pass: the tokens served past L1 and the load to wait on."""
        self._stop_prefetch()
        run = await self._verified(self._host_run + self._arrived)
        self._count(len(run))
        if not run:
            return 0, None
        first = self._l1_pages
        load, self._load = self._c.start_load(run, self._lease.pages[first : first + len(run)])
        self._load.add_done_callback(_log_crash)
        tokens = len(run) * self._c.page_size
        self._lease.cached_tokens += tokens
        return tokens, load

    def close(self) -> None:
        """Stop the prefetch and the load, unpin the L2 pages (safe at any point: a cancelled
        task copies nothing more)."""
        self._stop_prefetch()
        if self._load is not None:
            self._load.cancel()
        for page in self._pinned:
            self._c.host.unpin(page)
        self._pinned.clear()

    def _stop_prefetch(self) -> None:
        task = self._prefetch
        if task is not None and not task.done():
            task.cancel()

    async def _prefetch_run(self) -> None:
        """Bring the L3 run into L2 in order, ``PREFETCH_DEPTH`` reads in flight, until done, a
        miss (missing, corrupt: the rest is computed), or L2 is full."""
        c, began, read = self._c, time.monotonic(), 0
        window: deque[tuple[StoredPageHeader, asyncio.Future[StoredPage | None] | None]] = deque()
        headers = iter(self._disk_run)
        try:
            while True:
                await self._fill(window, headers)
                if not window:
                    break
                header, reading = window.popleft()
                if reading is None:  # it was in L2 already
                    page = c.host.pin(header.digest)
                else:
                    stored = await reading
                    page = None if stored is None else c.host_insert(stored)
                    read += page is not None
                if page is None:
                    break
                self._pinned.append(page)
                self._arrived.append(page)
        finally:
            for _, reading in window:
                if reading is not None:
                    reading.cancel()
            if read:
                c.metrics.prefetched(read, read * c.page_bytes, time.monotonic() - began)

    async def _fill(
        self,
        window: deque[tuple[StoredPageHeader, asyncio.Future[StoredPage | None] | None]],
        headers: Iterator[StoredPageHeader],
    ) -> None:
        """Start reads (through the rate limit) until ``PREFETCH_DEPTH`` are in flight."""
        c, storage = self._c, self._c.storage
        assert storage is not None
        while len(window) < PREFETCH_DEPTH:
            header = next(headers, None)
            if header is None:
                return
            if header.digest in c.host:
                window.append((header, None))
                continue
            await c.prefetch_limit.take(c.page_bytes)
            reading = asyncio.ensure_future(storage.read(header.digest))
            reading.add_done_callback(_log_crash)
            window.append((header, reading))

    async def _verified(self, pages: list[HostPage]) -> list[HostPage]:
        """``pages`` up to the first that fails its check (reported, dropped from L2)."""
        for index, page in enumerate(pages):
            if index and not index % _VERIFY_BATCH:
                await asyncio.sleep(0)
            try:
                self._c.host.verify(page)
            except PageCorrupt as exc:
                self._c.host_corrupt(page, exc)
                return pages[:index]
        return pages

    def _count(self, served: int) -> None:
        """Each tier's hit and miss tokens for this request (``worker.hicache.metrics``)."""
        size, metrics = self._c.page_size, self._c.metrics
        left = len(self._lease.tokens)
        host = min(served, len(self._host_run)) * size
        for tier, hit in ((GPU, self._l1_pages * size), (CPU_PINNED, host)):
            metrics.served(tier, hit, left - hit)
            left -= hit
        if self._c.storage is not None:
            disk = served * size - host
            metrics.served(DISK, disk, left - disk)


def _log_crash(task: asyncio.Future[Any]) -> None:
    """A done callback: log what a load or a read raised (a bug: they handle store errors)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("a tier copy crashed", exc_info=task.exception())
