"""L3 page stores: the seam (``base``), the page codec, the directory and Mooncake backends, and
``open_page_store``, the name -> backend table.

Imports run one way: ``codec`` imports ``base``; the backends (``directory``, ``mooncake``) import
``base`` and ``codec``; this package's ``open_page_store`` imports ``base`` and, when one is
chosen, its backend. ``base`` imports none of them.

May import: ``worker.hicache.stores.*`` only; nothing above.
"""

from __future__ import annotations

import logging
from pathlib import Path

from worker.hicache.stores.base import EvictCallback, FsyncPolicy, PageStore, PageStoreError

__all__ = ["BACKENDS", "open_page_store"]

logger = logging.getLogger(__name__)

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
