"""The tiered KV cache of one rank, after SGLang's HiCache controller (``HiCacheController``).

Tiers: L1 is the device pool and its prefix cache (``worker.kv``, ``worker.prefix_cache``), L2
the host pool (``worker.hicache.host_pool``), L3 a page store (``worker.hicache.storage_tier`` over
``worker.hicache.stores.base``). ``CacheController`` (one per rank, ``TierConfig`` for all) moves
pages
between them:

* backups, by ``write_policy``: ``write_through`` copies a page committed to L1 to L2 at once,
  and from L2 to L3 at once; ``write_through_selective`` does the same once the page has been hit
  ``selective_hits`` times (its commit counts as one hit; SGLang's default threshold is 2);
  ``write_back`` copies a page to L2 only when L1 evicts it, and to L3 only when L2 evicts it.
  Eviction cascades L1 -> L2 -> L3, each tier LRU; L3's capacity eviction is the store's. The
  controller learns each L1 page's ``StoredPageHeader`` when ``committed`` and hears of L1
  evictions through ``PrefixCache.on_evict`` (before the page is reused). L1 -> L2 copies of
  committed pages run in the background, ``BATCH_PAGES`` at a time, so a long prompt does not
  stall the event loop; a page evicted before its turn is copied at eviction;
* requests: ``fetch(lease)`` (at arrival) matches the prompt's leading full pages past its L1
  hit against L2 (pinned at once) and then L3, and starts prefetching the L3 run into L2 when it
  is at least ``prefetch_threshold_tokens`` long (``worker.hicache.fetch``);
* copy costs: every L1 <-> L2 copy reserves the host link (``host_bandwidth`` bytes/s; a backup
  in flight delays a load as on a PCIe link); L3 I/O is real file I/O plus the storage link
  (``storage_bandwidth``, 0: none); prefetch reads also pass a ``prefetch_rate`` token bucket;
* events: ``BlockStored`` / ``BlockRemoved`` with medium ``CPU_PINNED`` (L2) and ``DISK`` (L3)
  on the rank's feed (``events``, set while the feed is open), chained like the GPU ones;
* integrity: a page whose check fails on read back (L2: CRC-32, L3: the store's checksum) is
  dropped, counted (``pd_worker_hicache_corrupt_pages_total``) and logged once per tier; the
  prefix from it on is recomputed.

With no host pages (the default) there is no controller at all: the worker behaves as before.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict

from transfer.closing import cancel_and_wait
from transfer.events import KVEvent
from worker.block_hash import BlockKey
from worker.hicache.config import TierConfig
from worker.hicache.costs import Link, TokenBucket
from worker.hicache.events import CPU_PINNED, DISK, removed_events, stored_events
from worker.hicache.fetch import TierFetch
from worker.hicache.host_pool import HostPage, HostPool
from worker.hicache.layer_loading import LayerLoad, run_layers
from worker.hicache.metrics import RankTierMetrics
from worker.hicache.storage_tier import StorageTier
from worker.hicache.stores.base import PageStore, StoredPage, StoredPageHeader
from worker.kv import KVPool
from worker.prefix_cache import EventSink, Lease

__all__ = ["BATCH_PAGES", "CacheController", "TierConfig"]

logger = logging.getLogger(__name__)

BATCH_PAGES = 8  # L1 -> L2 background copies between two event-loop yields


class CacheController:
    """One rank's tiers (module docstring); ``start`` opens L3, ``aclose`` closes it."""

    def __init__(self, config: TierConfig, pool: KVPool, metrics: RankTierMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.page_size = pool.shape.page_size
        self.page_bytes = pool.page_bytes
        self.host = HostPool(config.host_pages, self.page_bytes, on_evict=self._host_evicted)
        self.link = Link(config.host_bandwidth)
        self.prefetch_limit = TokenBucket(config.prefetch_rate, self.page_bytes)
        self.storage: StorageTier | None = None
        self.events: EventSink | None = None
        self._l1: dict[int, StoredPageHeader] = {}  # L1 page -> the block it caches
        self._hits: dict[bytes, int] = {}
        self._backlog: OrderedDict[int, StoredPageHeader] = OrderedDict()  # L1 -> L2 to copy
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._corrupt_logged: set[str] = set()
        pool.cache.on_evict = self._l1_evicted
        metrics.held(CPU_PINNED, lambda: len(self.host))
        metrics.held(DISK, lambda: len(self.storage) if self.storage is not None else 0)

    async def start(self, store: PageStore | None) -> None:
        """Start the background copies; with ``store``, L3 (its scan announces what it holds)."""
        self._task = asyncio.create_task(self._backup_loop(), name="l2-backup")
        if store is not None:
            self.storage = StorageTier(
                store,
                page_bytes=self.page_bytes,
                page_size=self.page_size,
                bandwidth=self.config.storage_bandwidth,
                metrics=self.metrics,
                emit=self.emit,
                corrupt=self.corrupt,
            )
            self.storage.start()

    async def aclose(self) -> None:
        """Copy what is still due to L2 (and so L3), let L3 writes land, stop."""
        await cancel_and_wait([self._task])
        while self._backlog:
            self._copy_to_host(self._next_batch())
            await asyncio.sleep(0)
        if self.storage is not None:
            await self.storage.aclose()

    @property
    def backlog(self) -> int:
        """L1 pages whose copy to L2 is due and not yet done."""
        return len(self._backlog)

    def status(self) -> dict[str, object]:
        """Occupancy for ``/health``: L2 pages, L3 pages, whether L3's start-up scan is done."""
        storage = self.storage
        return {
            "host_pages": len(self.host),
            "host_capacity": self.host.num_pages,
            "storage_pages": None if storage is None else len(storage),
            "storage_scanned": None if storage is None else storage.scanned.is_set(),
        }

    def store_evicted(self, headers: list[StoredPageHeader]) -> None:
        """The store's ``on_evict`` (given to it before ``start``)."""
        if self.storage is not None:
            self.storage.evicted(headers)

    def emit(self, events: list[KVEvent]) -> None:
        if events and self.events is not None:
            self.events(events)

    def corrupt(self, tier: str, digest: bytes, error: Exception) -> None:
        """Count a page that failed its check; log the first of each tier at WARNING."""
        self.metrics.corrupt(tier)
        level = logging.DEBUG if tier in self._corrupt_logged else logging.WARNING
        self._corrupt_logged.add(tier)
        logger.log(level, "%s page %s dropped, recomputed: %s", tier, digest.hex(), error)

    # --- L1 -------------------------------------------------------------------------------------

    def committed(self, lease: Lease, stored: list[int]) -> None:
        """``lease``'s positions ``stored`` entered L1: record their headers, count a hit."""
        for index in stored:
            page = lease.pages[index]
            self._l1[page] = self._header(lease, index)
            self._hit(page)

    def _header(self, lease: Lease, index: int) -> StoredPageHeader:
        key, size = lease.keys[index], self.page_size
        parent: BlockKey | None = lease.keys[index - 1] if index else None
        return StoredPageHeader(
            digest=key.digest,
            event_id=key.event_id,
            parent_digest=None if parent is None else parent.digest,
            parent_event_id=None if parent is None else parent.event_id,
            position=index,
            token_ids=tuple(lease.tokens[index * size : (index + 1) * size]),
        )

    def _hit(self, page: int) -> None:
        header = self._l1.get(page)
        if header is None:
            return
        count = self._hits.get(header.digest, 0) + 1
        self._hits[header.digest] = count
        threshold = self.config.backup_hits
        due = threshold and count >= threshold and header.digest not in self.host
        if due and page not in self._backlog:
            self._backlog[page] = header
            self._wake.set()

    def _l1_evicted(self, evicted: list[tuple[int, BlockKey]]) -> None:
        """``PrefixCache.on_evict``: copy what the policy keeps to L2 now (pages intact)."""
        keep: list[tuple[int, StoredPageHeader]] = []
        for page, key in evicted:
            header = self._l1.pop(page, None)
            self._hits.pop(key.digest, None)
            due = self._backlog.pop(page, None) is not None
            if header is not None and (due or self.config.write_policy == "write_back"):
                keep.append((page, header))
        if keep:
            self._copy_to_host(keep)

    def clear(self) -> None:
        """After ``PrefixCache.clear`` (its ``AllBlocksCleared`` covers every tier): forget L1
        and L2, keep L3 and announce it again."""
        self._l1.clear()
        self._hits.clear()
        self._backlog.clear()
        self.host.clear()
        if self.storage is not None:
            self.storage.announce()

    # --- L1 -> L2 -> L3 -------------------------------------------------------------------------

    async def _backup_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._backlog:
                self._copy_to_host(self._next_batch())
                await asyncio.sleep(0)

    def _next_batch(self) -> list[tuple[int, StoredPageHeader]]:
        count = min(BATCH_PAGES, len(self._backlog))
        return [self._backlog.popitem(last=False) for _ in range(count)]

    def _copy_to_host(self, items: list[tuple[int, StoredPageHeader]]) -> None:
        """Copy L1 pages into L2 (reserving the host link); write-through: on to L3."""
        began = time.monotonic()
        copied: list[StoredPageHeader] = []
        for page, header in items:
            if header.digest in self.host:
                self.host.touch(header.digest)
            else:
                fill = functools.partial(self.pool.copy_page_out, page)
                if self.host.put(header, fill) is not None:
                    copied.append(header)
        copied = [header for header in copied if header.digest in self.host]
        if not copied:
            return
        nbytes = len(copied) * self.page_bytes
        _, end = self.link.reserve(nbytes)
        self.metrics.backed_up(CPU_PINNED, len(copied), nbytes, end - began)
        self.emit(stored_events(copied, CPU_PINNED, self.page_size))
        if self.config.write_policy != "write_back":
            for header in copied:
                self._to_storage(header)

    def _to_storage(self, header: StoredPageHeader) -> None:
        page = self.host.get(header.digest)
        if self.storage is not None and page is not None and header.digest not in self.storage:
            self.storage.submit(StoredPage(header, bytes(self.host.view(page))))

    def _host_evicted(self, header: StoredPageHeader, data: memoryview) -> None:
        """``HostPool.on_evict``: announce; write-back: on to L3 (the bytes are still there)."""
        self.emit(removed_events([header], CPU_PINNED))
        storage = self.storage
        write_back = self.config.write_policy == "write_back"
        if write_back and storage is not None and header.digest not in storage:
            storage.submit(StoredPage(header, bytes(data)))

    # --- requests -------------------------------------------------------------------------------

    def fetch(self, lease: Lease) -> TierFetch:
        """At a request's arrival: count its L1 hits, pin its L2 run, find its L3 run (and
        start prefetching it when long enough); see ``TierFetch``."""
        for page in lease.pages[: lease.committed]:
            self._hit(page)
        reusable = max(len(lease.tokens) - 1, 0) // self.page_size
        keys = lease.keys[lease.committed : reusable]
        host_run: list[HostPage] = []
        for key in keys:
            held = self.host.pin(key.digest)
            if held is None:
                break
            host_run.append(held)
        disk_run: list[StoredPageHeader] = []
        if self.storage is not None:
            index = self.storage.index
            for key in keys[len(host_run) :]:
                header = index.get(key.digest)
                if header is None:
                    break
                disk_run.append(header)
        return TierFetch(self, lease, host_run, disk_run)

    def host_insert(self, page: StoredPage) -> HostPage | None:
        """A prefetched page into L2, pinned (None when L2 has no unpinned slot)."""
        header = page.header
        fresh = header.digest not in self.host
        held = self.host.put(header, functools.partial(_fill, page.data))
        if held is None:
            return None
        self.host.pin(header.digest)
        if fresh:
            self.emit(stored_events([header], CPU_PINNED, self.page_size))
        return held

    def host_corrupt(self, page: HostPage, error: Exception) -> None:
        """An L2 page failed its check (``HostPool.verify`` removed it)."""
        self.emit(removed_events([page.header], CPU_PINNED))
        self.corrupt(CPU_PINNED, page.header.digest, error)

    def start_load(
        self, pages: list[HostPage], targets: list[int]
    ) -> tuple[LayerLoad, asyncio.Task[None]]:
        """Load verified, pinned L2 ``pages`` into L1 ``targets`` layer by layer over the host
        link; the task ends when the last layer is in."""
        load = LayerLoad(self.pool.shape.layers)
        nbytes = len(pages) * self.page_bytes
        began = time.monotonic()
        start, end = self.link.reserve(nbytes)

        def copy_layer(layer: int) -> None:
            for page, target in zip(pages, targets, strict=True):
                self.pool.copy_layer_in(target, layer, self.host.view(page))

        async def run() -> None:
            await run_layers(load, start, end, copy_layer)
            self.metrics.loaded(len(pages), nbytes, time.monotonic() - began)

        return load, asyncio.create_task(run(), name="l2-load")


def _fill(data: bytes, view: memoryview) -> None:
    view[:] = data
