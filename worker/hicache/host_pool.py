"""The host memory tier (L2) of a rank's KV cache: whole pages in one preallocated buffer.

``HostPool(num_pages, page_bytes)`` keeps up to ``num_pages`` KV pages (the layout of
``worker.hicache.stores.base.StoredPage.data``), each under its block digest with its
``StoredPageHeader`` and a CRC-32 of its bytes taken when it was written. Every read back goes
through ``verify``, which recomputes the CRC; a page that fails is dropped and ``PageCorrupt`` is
raised, so the caller recomputes the prefix instead of serving it.

Eviction is LRU over the pages nobody has pinned: ``put`` takes a free slot, else evicts the least
recently used unpinned page, calling ``on_evict(header, bytes)`` first (synchronously, while the
bytes are still there: the write-back policy copies them to storage). A pinned page (a load or a
prefetch is using it) is never evicted nor reused; one removed while pinned (``verify`` failed,
``clear``) leaves the index at once and frees its slot at its last ``unpin``.

Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from worker.hicache.stores.base import PageCorrupt, StoredPageHeader

__all__ = ["HostEvict", "HostPage", "HostPool"]

HostEvict = Callable[[StoredPageHeader, memoryview], None]


@dataclass(eq=False, slots=True)
class HostPage:
    """One page held in the pool: its slot, header and checksum (a handle for ``pin``)."""

    slot: int
    header: StoredPageHeader
    checksum: int
    pins: int = 0
    removed: bool = False


class HostPool:
    """``num_pages`` slots of ``page_bytes`` bytes in one buffer, indexed by block digest."""

    def __init__(self, num_pages: int, page_bytes: int, on_evict: HostEvict | None = None) -> None:
        if num_pages < 1 or page_bytes < 1:
            raise ValueError("num_pages and page_bytes must be >= 1")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.on_evict = on_evict
        self.data = bytearray(num_pages * page_bytes)
        self._view = memoryview(self.data)
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict[bytes, HostPage] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # unpinned pages, oldest first

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._pages

    def headers(self) -> list[StoredPageHeader]:
        return [page.header for page in self._pages.values()]

    def put(self, header: StoredPageHeader, fill: Callable[[memoryview], None]) -> HostPage | None:
        """Store a page (``fill`` writes its bytes into the slot) and mark it most recently
        used; an already stored digest is only marked. None when every slot is pinned."""
        held = self._pages.get(header.digest)
        if held is not None:
            self.touch(header.digest)
            return held
        slot = self._take_slot()
        if slot is None:
            return None
        view = self.view_slot(slot)
        fill(view)
        page = HostPage(slot, header, zlib.crc32(view))
        self._pages[header.digest] = page
        self._lru[header.digest] = None
        return page

    def get(self, digest: bytes) -> HostPage | None:
        """The page under ``digest`` (not pinned, not marked used), or None."""
        return self._pages.get(digest)

    def pin(self, digest: bytes) -> HostPage | None:
        """The page under ``digest``, pinned (never evicted until ``unpin``); None if absent."""
        page = self._pages.get(digest)
        if page is not None:
            page.pins += 1
            self._lru.pop(digest, None)
        return page

    def unpin(self, page: HostPage) -> None:
        page.pins -= 1
        if page.pins:
            return
        if page.removed:
            self._free.append(page.slot)
        else:
            self._lru[page.header.digest] = None

    def touch(self, digest: bytes) -> None:
        """Mark an unpinned page most recently used."""
        if digest in self._lru:
            self._lru.move_to_end(digest)

    def view(self, page: HostPage) -> memoryview:
        """The page's bytes as stored (no check: ``verify`` first)."""
        return self.view_slot(page.slot)

    def view_slot(self, slot: int) -> memoryview:
        return self._view[slot * self.page_bytes : (slot + 1) * self.page_bytes]

    def verify(self, page: HostPage) -> None:
        """Raise ``PageCorrupt`` (after removing the page) when its bytes changed since put."""
        if zlib.crc32(self.view(page)) != page.checksum:
            self.remove(page.header.digest)
            raise PageCorrupt(f"host page {page.header.digest.hex()} failed its CRC-32 check")

    def remove(self, digest: bytes) -> StoredPageHeader | None:
        """Forget ``digest`` (its slot is freed now, or at its last ``unpin``)."""
        page = self._pages.pop(digest, None)
        if page is None:
            return None
        page.removed = True
        self._lru.pop(digest, None)
        if not page.pins:
            self._free.append(page.slot)
        return page.header

    def clear(self) -> list[StoredPageHeader]:
        """Forget every page; returns their headers."""
        return [h for h in (self.remove(d) for d in list(self._pages)) if h is not None]

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        digest, _ = self._lru.popitem(last=False)
        page = self._pages.pop(digest)
        page.removed = True
        if self.on_evict is not None:
            self.on_evict(page.header, self.view_slot(page.slot))
        return page.slot
