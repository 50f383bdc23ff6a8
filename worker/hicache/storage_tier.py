"""The storage tier (L3) of a rank's KV cache: a ``PageStore`` and what the controller knows of it.

``StorageTier`` wraps one opened ``PageStore`` (``worker.hicache.stores.base``) with:

* the in-memory index of the pages it holds (digest -> ``StoredPageHeader``), which the request
  path matches against without I/O: filled by ``scan()`` at start (the store checks each page's
  integrity), updated as backups land, as the store evicts (its ``on_evict``, see ``evicted``)
  and as reads find pages missing or corrupt. The Mooncake backend cannot list its keys, so there
  the index knows only the pages this process stored;
* a background writer: ``submit`` queues a page to back up (deduplicated, at most
  ``max_pending_bytes`` queued; beyond that a backup is dropped), the writer puts them in batches
  of ``BATCH_PAGES`` and announces them as ``BlockStored(medium="DISK")``;
* the storage link (``worker.hicache.costs.Link``): with a ``bandwidth`` (bytes/s) every read and
  write also waits for its share of the link, on top of the real I/O; 0: the real I/O only;
* ``announce``: every indexed page as ``BlockStored(DISK)``, parents first (after the start-up
  scan, so a restarted worker tells its subscribers what it can serve, and after a cache reset).

A read that fails its check (``PageCorrupt``: the store deleted the page) or returns a page of
another pool shape drops the page from the index, announces ``BlockRemoved(DISK)`` and reports it;
the caller gets None and recomputes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from transfer.closing import cancel_and_wait
from transfer.events import KVEvent
from worker.hicache.costs import Link, sleep_until
from worker.hicache.events import DISK, removed_events, stored_events
from worker.hicache.metrics import RankTierMetrics
from worker.hicache.stores.base import (
    PageCorrupt,
    PageStore,
    PageStoreError,
    StoredPage,
    StoredPageHeader,
)

__all__ = ["BATCH_PAGES", "StorageTier"]

logger = logging.getLogger(__name__)

BATCH_PAGES = 16  # pages per store.put, and per announced chunk (x16)
_DRAIN_S = 10.0  # how long aclose waits for queued backups to land


class StorageTier:
    """One rank's L3: a page store, its index, its writer and its link (module docstring)."""

    def __init__(
        self,
        store: PageStore,
        *,
        page_bytes: int,
        page_size: int,
        bandwidth: float,
        metrics: RankTierMetrics,
        emit: Callable[[list[KVEvent]], None],
        corrupt: Callable[[str, bytes, Exception], None],
        max_pending_bytes: int = 256 << 20,
    ) -> None:
        self.store = store
        self.index: dict[bytes, StoredPageHeader] = {}
        self.link = Link(bandwidth)
        self.scanned = asyncio.Event()
        self._page_bytes = page_bytes
        self._page_size = page_size
        self._metrics = metrics
        self._emit = emit
        self._corrupt = corrupt
        self._max_pending = max(max_pending_bytes // page_bytes, BATCH_PAGES)
        self._queue: deque[StoredPage] = deque()
        self._pending: set[bytes] = set()  # queued or being put
        self._evicted_pending: set[bytes] = set()  # evicted by the store while being put
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._warned = False

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def idle(self) -> bool:
        """Whether no backup is queued or being written."""
        return self._idle.is_set()

    def start(self) -> None:
        """Start the writer and the scan of what the store already holds."""
        self._tasks.append(asyncio.create_task(self._writer(), name="l3-writer"))
        self._tasks.append(asyncio.create_task(self._scan(), name="l3-scan"))

    async def aclose(self) -> None:
        """Let queued backups land (up to ``_DRAIN_S``), stop, close the store."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _DRAIN_S)
        await cancel_and_wait(self._tasks)
        await self.store.aclose()

    # --- backups -------------------------------------------------------------------------------

    def submit(self, page: StoredPage) -> None:
        """Queue ``page`` for storage unless it is stored, queued, or the queue is full."""
        digest = page.header.digest
        if digest in self.index or digest in self._pending:
            return
        if len(self._queue) >= self._max_pending:
            logger.debug("L3 backup queue full: page %s not stored", digest.hex())
            return
        self._pending.add(digest)
        self._queue.append(page)
        self._idle.clear()
        self._wake.set()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(BATCH_PAGES, len(self._queue)))]
                await self._put(batch)
            self._idle.set()

    async def _put(self, batch: list[StoredPage]) -> None:
        began = time.monotonic()
        nbytes = sum(len(page.data) for page in batch)
        _, end = self.link.reserve(nbytes)
        try:
            await self.store.put(batch)
            await sleep_until(end)
        except PageStoreError as exc:
            self._warn(f"L3 backup of {len(batch)} pages failed: {exc}")
            return
        finally:
            for page in batch:
                self._pending.discard(page.header.digest)
        landed = [p.header for p in batch if p.header.digest not in self._evicted_pending]
        self._evicted_pending.difference_update(p.header.digest for p in batch)
        for header in landed:
            self.index[header.digest] = header
        self._metrics.backed_up(DISK, len(batch), nbytes, time.monotonic() - began)
        self._emit(stored_events(landed, DISK, self._page_size))

    # --- reads ---------------------------------------------------------------------------------

    async def read(self, digest: bytes) -> StoredPage | None:
        """The verified page (real I/O, then the link's share), or None when it is missing,
        corrupt (reported), of another pool shape, or the store failed."""
        _, end = self.link.reserve(self._page_bytes)
        try:
            page = await self.store.get(digest)
        except PageCorrupt as exc:
            self.drop(digest)
            self._corrupt(DISK, digest, exc)
            return None
        except PageStoreError as exc:
            self._warn(f"L3 read of page {digest.hex()} failed: {exc}")
            return None
        if page is not None and len(page.data) != self._page_bytes:
            self._warn(f"L3 page {digest.hex()} has {len(page.data)} bytes, not {self._page_bytes}")
            await self._forget(digest)
            return None
        if page is None:
            self.drop(digest)
            return None
        await sleep_until(end)
        return page

    def drop(self, digest: bytes) -> None:
        """Forget ``digest`` (gone from the store) and announce it."""
        header = self.index.pop(digest, None)
        if header is not None:
            self._emit(removed_events([header], DISK))

    async def _forget(self, digest: bytes) -> None:
        self.drop(digest)
        with contextlib.suppress(PageStoreError):
            await self.store.delete([digest])

    def evicted(self, headers: Sequence[StoredPageHeader]) -> None:
        """The store's ``on_evict``: it deleted ``headers`` to make room."""
        gone: list[StoredPageHeader] = []
        for header in headers:
            if header.digest in self._pending:
                self._evicted_pending.add(header.digest)
            if self.index.pop(header.digest, None) is not None:
                gone.append(header)
        self._emit(removed_events(gone, DISK))

    # --- scan and announcements ----------------------------------------------------------------

    async def _scan(self) -> None:
        found: list[StoredPageHeader] = []
        try:
            async for header in self.store.scan():
                if header.digest not in self.index:
                    self.index[header.digest] = header
                    found.append(header)
        except PageStoreError as exc:
            self._warn(f"L3 scan failed after {len(found)} pages: {exc}")
        if found:
            logger.info("L3: %d stored pages found at start", len(found))
        self.scanned.set()
        await self._announce(found)

    def announce(self) -> None:
        """Announce every indexed page again (after a cache reset), in the background."""
        headers = list(self.index.values())
        self._tasks.append(asyncio.create_task(self._announce(headers), name="l3-announce"))

    async def _announce(self, headers: list[StoredPageHeader]) -> None:
        headers.sort(key=lambda header: header.position)  # parents before children
        chunk = BATCH_PAGES * 16
        for first in range(0, len(headers), chunk):
            live = [h for h in headers[first : first + chunk] if h.digest in self.index]
            self._emit(stored_events(live, DISK, self._page_size))
            await asyncio.sleep(0)

    def _warn(self, message: str) -> None:
        """Log a storage failure: the first at WARNING, the rest at DEBUG."""
        logger.log(logging.DEBUG if self._warned else logging.WARNING, message)
        self._warned = True
