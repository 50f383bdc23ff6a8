"""The storage tier (L3) of a rank's KV cache hierarchy: whole KV pages kept by block key.

A ``PageStore`` keeps ``StoredPage``s: one full page of one prompt (its chained block key, its
parent's key, its position and token ids) with the page's KV bytes. The cache controller
(``worker.hicache.controller``) backs pages up into it and prefetches them out of it; it never
looks inside the bytes. Backends: ``worker.hicache.stores.directory`` (a local directory) and
``worker.hicache.stores.mooncake`` (the Mooncake distributed store); ``open_page_store`` picks one.

Integrity is the store's job: ``get`` returns a page only when its bytes are exactly what was put
(a checksum over header and data); a page that fails the check is deleted and reported as
``PageCorrupt``, so the caller recomputes it instead of serving it.

The KV bytes of a page (``StoredPage.data``) are its regions in the pool's region order (region
``r`` = layer ``r % layers``, ``kv = r // layers``), each ``page_bytes`` long, so layer ``l``'s
slices are regions ``l`` and ``l + layers``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

__all__ = [
    "BACKENDS",
    "EvictCallback",
    "FsyncPolicy",
    "PageCorrupt",
    "PageStore",
    "PageStoreError",
    "StoredPage",
    "StoredPageHeader",
    "open_page_store",
]

logger = logging.getLogger(__name__)


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

BACKENDS = ("file", "mooncake")


def open_page_store(
    backend: str,
    *,
    directory: Path | None = None,
    capacity_pages: int | None = None,
    fsync: FsyncPolicy = "never",
    mooncake_master: str | None = None,
    mooncake_metadata: str = "P2PHANDSHAKE",
    mooncake_key_prefix: str = "",
    on_evict: EvictCallback | None = None,
) -> PageStore:
    """The ``backend`` ("file" or "mooncake") store, its module imported only when chosen.

    "file" needs ``directory`` and uses ``capacity_pages``, ``fsync`` and ``on_evict``;
    "mooncake" needs ``mooncake_master`` (``host:port``) and uses ``mooncake_metadata`` (the
    transfer engine's metadata server: ``P2PHANDSHAKE`` or an ``http://…/metadata`` URL) and
    ``mooncake_key_prefix`` (one per model and rank: digests hash tokens only); the distributed
    store evicts by itself, without reporting, so it ignores ``capacity_pages`` (with a warning)
    and ``on_evict``. Raises ``PageStoreError`` for an unknown backend or a missing argument.
    """
    if backend == "file":
        if directory is None:
            raise PageStoreError("the file page store needs a directory")
        from worker.hicache.stores.directory import DirectoryPageStore

        return DirectoryPageStore(
            directory, capacity_pages=capacity_pages, fsync=fsync, on_evict=on_evict
        )
    if backend == "mooncake":
        if mooncake_master is None:
            raise PageStoreError("the mooncake page store needs the master's address")
        from worker.hicache.stores.mooncake import MooncakePageStore

        if capacity_pages is not None:
            logger.warning("the mooncake page store ignores capacity_pages: the master evicts")
        return MooncakePageStore(
            mooncake_master, metadata_server=mooncake_metadata, key_prefix=mooncake_key_prefix
        )
    raise PageStoreError(f"unknown page store backend {backend!r} (known: {', '.join(BACKENDS)})")
