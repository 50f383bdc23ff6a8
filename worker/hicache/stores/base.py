"""The storage tier (L3) of a rank's KV cache hierarchy: whole KV pages kept by block key.

A ``PageStore`` keeps ``StoredPage``s: one full page of one prompt (its chained block key, its
parent's key, its position and token ids) with the page's KV bytes. The cache controller
(``worker.hicache.controller``) backs pages up into it and prefetches them out of it; it never
looks inside the bytes. Backends: ``worker.hicache.stores.directory`` (a local directory) and
``worker.hicache.stores.mooncake`` (the Mooncake distributed store);
``worker.hicache.stores.open_page_store`` picks one. This module is the seam only: it imports no
backend (they import it).

Integrity is the store's job: ``get`` returns a page only when its bytes are exactly what was put
(a checksum over header and data); a page that fails the check is deleted and reported as
``PageCorrupt``, so the caller recomputes it instead of serving it.

The KV bytes of a page (``StoredPage.data``) are its regions in the pool's region order (region
``r`` = layer ``r % layers``, ``kv = r // layers``), each ``page_bytes`` long, so layer ``l``'s
slices are regions ``l`` and ``l + layers``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = [
    "EvictCallback",
    "FsyncPolicy",
    "PageCorrupt",
    "PageStore",
    "PageStoreError",
    "StoredPage",
    "StoredPageHeader",
]


class PageStoreError(Exception):
    """Base of the page store errors (a backend that cannot be reached or written)."""


class PageCorrupt(PageStoreError):
    """A stored page failed its integrity check (it has been deleted)."""


@dataclass(frozen=True, slots=True)
class StoredPageHeader:
    """What identifies a stored page, without its KV bytes."""

    digest: bytes  # ``BlockKey.digest`` (the cache's key)
    event_id: int  # ``BlockKey.event_id`` (the id in KV events)
    parent_digest: bytes | None  # the previous page's key (None: the prompt's first page)
    parent_event_id: int | None
    position: int  # the page's index in its prompt (0 = first)
    token_ids: tuple[int, ...]  # the page's tokens (``page_size`` of them)


@dataclass(frozen=True, slots=True)
class StoredPage:
    header: StoredPageHeader
    data: bytes  # the page's KV, regions in pool order (module docstring)


class PageStore(Protocol):
    """A bounded-or-not store of KV pages keyed by ``StoredPageHeader.digest``."""

    async def put(self, pages: Sequence[StoredPage]) -> None:
        """Store ``pages`` (a digest already stored is left as it is); durable per the
        backend's documented fsync policy when this returns. Raises ``PageStoreError``."""
        ...

    async def get(self, digest: bytes) -> StoredPage | None:
        """The page stored under ``digest``, verified; None when absent. Raises ``PageCorrupt``
        (after deleting it) when its bytes fail the check, ``PageStoreError`` on I/O errors."""
        ...

    async def exists(self, digests: Sequence[bytes]) -> list[bool]:
        """Which of ``digests`` are stored (no integrity check)."""
        ...

    async def delete(self, digests: Sequence[bytes]) -> None:
        """Forget ``digests`` (absent ones are ignored)."""
        ...

    def scan(self) -> AsyncIterator[StoredPageHeader]:
        """Every stored page whose integrity check passes (corrupt ones are deleted), for a
        restarted worker to rebuild its index."""
        ...

    async def aclose(self) -> None:
        """Release the backend's resources."""
        ...


# What a bounded backend calls with the headers of the pages it evicted to make room (not those
# deleted by ``delete``, nor corrupt ones, which ``get`` reports as ``PageCorrupt``): the cache
# controller turns them into ``BlockRemoved(medium="DISK")``. Called on the event loop.
EvictCallback = Callable[[list[StoredPageHeader]], None]

# "never": no fsync (a crash may lose recent pages, never tear one: writes are atomic renames and
# pages are checksummed); "page": fsync each page file and its directory before ``put`` returns.
FsyncPolicy = Literal["never", "page"]
