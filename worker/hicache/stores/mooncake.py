"""``MooncakePageStore``: the L3 page store on the Mooncake distributed store (``mooncake.store``).

Each page is one object: key ``<key_prefix><digest hex>``, value ``worker.hicache.stores.codec``'s
self-checking encoding (the same bytes the directory backend writes), so ``get`` verifies what
comes back and deletes (``remove(force=True)``) a value that fails.

The client joins a ``mooncake_master`` (``master``, ``host:port``) and contributes
``global_segment_bytes`` of its own memory to the store; puts are staged through a
``local_buffer_bytes`` buffer, so a page (plus its header) must fit there, and concurrent puts
share it (a put that finds it full fails with ``PageStoreError``; a cache put may simply be
dropped). Objects held in a client's segment vanish when that client closes, and the master evicts
by itself when memory runs short: neither is reported, so this store takes no ``on_evict``.

The key prefix must separate whatever shares the store with different bytes under equal digests:
digests hash tokens only, so two models, or two tensor-parallel ranks of one, must not share a
prefix (the checksum cannot tell a wrong model's page from a right one).

``scan()`` yields nothing: the client cannot list keys. A restarted worker starts with an empty
index and finds surviving pages through ``exists``/``get``.

The client's calls block (RPCs to the master and data transfers), so each runs in a worker
thread; the client is thread-safe (checked here with 8 threads of concurrent put/get over tcp).
``connect()`` runs ``setup`` (the first call does it otherwise).

Tested against a real ``mooncake_master`` on loopback TCP (``testkit.mooncake_master``), with the
transfer engine's metadata through P2PHANDSHAKE or the master's HTTP metadata server.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

from worker.hicache.stores.base import PageCorrupt, PageStoreError, StoredPage, StoredPageHeader
from worker.hicache.stores.codec import MAX_HEADER_BYTES, PREFIX, decode_page, encode_page

__all__ = ["MooncakePageStore"]

logger = logging.getLogger(__name__)

_OBJECT_NOT_FOUND = -704  # Mooncake's error code for remove() of an absent key
_RECORD_SLACK = PREFIX.size + MAX_HEADER_BYTES  # the encoding's bytes beyond the data, at most

T = TypeVar("T")


class _Native(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` (untyped pybind11) used here."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        /,
    ) -> int: ...

    def put(self, key: str, value: bytes, /) -> int: ...

    def get(self, key: str, /) -> bytes: ...

    def batch_is_exist(self, keys: list[str], /) -> list[int]: ...

    def remove(self, key: str, force: bool = ..., /) -> int: ...

    def close(self) -> int: ...


def _load_native() -> Callable[[], _Native]:
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise PageStoreError(
            "the Mooncake store is missing: pip install mooncake-transfer-engine-non-cuda "
            "(it needs Debian's libibverbs1 librdmacm1 libnuma1)"
        ) from exc
    factory: Callable[[], _Native] = module.MooncakeDistributedStore
    return factory


class MooncakePageStore:
    """A ``PageStore`` on a Mooncake store reached through ``master`` (module docstring)."""

    def __init__(
        self,
        master: str,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        key_prefix: str = "",
        global_segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 64 << 20,
        max_page_bytes: int = 32 << 20,
    ) -> None:
        if max_page_bytes + _RECORD_SLACK > local_buffer_bytes:
            raise ValueError(
                f"max_page_bytes={max_page_bytes} does not fit local_buffer_bytes="
                f"{local_buffer_bytes} (a put is staged there whole, with up to "
                f"{_RECORD_SLACK} bytes of header)"
            )
        self.master = master
        self.metadata_server = metadata_server
        self.local_hostname = local_hostname
        self.protocol = protocol
        self.device = device
        self.key_prefix = key_prefix
        self.global_segment_bytes = global_segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self.max_page_bytes = max_page_bytes
        self._factory = _load_native()
        self._native: _Native | None = None
        self._connecting = asyncio.Lock()
        self._closed = False

    async def connect(self) -> None:
        """Join the store (``setup``); idempotent. Raises ``PageStoreError`` when it fails."""
        async with self._connecting:
            if self._closed:
                raise PageStoreError(f"mooncake page store ({self.master}) is closed")
            if self._native is None:
                self._native = await _in_thread(self._setup)

    async def put(self, pages: Sequence[StoredPage]) -> None:
        """Store each page (a key already there is left as it is); ``PageStoreError`` naming
        the pages Mooncake refused (the others are stored). Nothing is fsynced: memory tier."""
        for page in pages:
            if len(page.data) > self.max_page_bytes:
                raise PageStoreError(
                    f"page {page.header.digest.hex()} has {len(page.data)} bytes of data, "
                    f"over max_page_bytes={self.max_page_bytes}"
                )
        native = await self._client()
        failed = await _in_thread(self._put_all, native, list(pages))
        if failed:
            listed = ", ".join(f"{digest.hex()[:16]}… ({code})" for digest, code in failed[:4])
            raise PageStoreError(f"mooncake refused {len(failed)} of {len(pages)} pages: {listed}")

    async def get(self, digest: bytes) -> StoredPage | None:
        """The verified page or None (absent, or a value the client could not fetch: Mooncake's
        ``get`` reports both as empty); a corrupt value is removed and raises ``PageCorrupt``."""
        native = await self._client()
        return await _in_thread(self._get, native, digest)

    async def exists(self, digests: Sequence[bytes]) -> list[bool]:
        """Whether each key is in the store (one batched RPC, no integrity check)."""
        if not digests:
            return []
        native = await self._client()
        codes = await _in_thread(native.batch_is_exist, [self._key(d) for d in digests])
        if any(code < 0 for code in codes):
            raise PageStoreError(f"mooncake batch_is_exist failed: {codes}")
        return [code == 1 for code in codes]

    async def delete(self, digests: Sequence[bytes]) -> None:
        """Remove the keys (absent ones are ignored; leases are overridden)."""
        if not digests:
            return
        native = await self._client()
        failed = await _in_thread(self._remove_all, native, list(digests))
        if failed:
            raise PageStoreError(f"mooncake could not remove {len(failed)} pages: {failed[:4]}")

    async def scan(self) -> AsyncIterator[StoredPageHeader]:
        """Nothing: the Mooncake client cannot list keys (module docstring)."""
        nothing: tuple[StoredPageHeader, ...] = ()
        for header in nothing:
            yield header

    async def aclose(self) -> None:
        """Leave the store (``close``): the pages in this client's segment go with it."""
        async with self._connecting:
            self._closed = True
            native, self._native = self._native, None
        if native is not None:
            code = await _in_thread(native.close)
            if code != 0:
                logger.warning("mooncake page store: close returned %d", code)

    # -- internals ---------------------------------------------------------------------------

    def _key(self, digest: bytes) -> str:
        return self.key_prefix + digest.hex()

    async def _client(self) -> _Native:
        if self._native is None:
            await self.connect()
        native = self._native
        if native is None:  # closed while connecting
            raise PageStoreError(f"mooncake page store ({self.master}) is closed")
        return native

    def _setup(self) -> _Native:
        native = self._factory()
        code = native.setup(
            self.local_hostname,
            self.metadata_server,
            self.global_segment_bytes,
            self.local_buffer_bytes,
            self.protocol,
            self.device,
            self.master,
        )
        if code != 0:
            raise PageStoreError(
                f"mooncake setup failed ({code}): master {self.master}, metadata "
                f"{self.metadata_server}, {self.protocol} on {self.local_hostname}"
            )
        logger.info("mooncake page store joined master %s as %s", self.master, self.local_hostname)
        return native

    def _put_all(self, native: _Native, pages: list[StoredPage]) -> list[tuple[bytes, int]]:
        failed: list[tuple[bytes, int]] = []
        for page in pages:
            head, data = encode_page(page)
            code = native.put(self._key(page.header.digest), head + data)
            if code != 0:
                failed.append((page.header.digest, code))
        return failed

    def _get(self, native: _Native, digest: bytes) -> StoredPage | None:
        key = self._key(digest)
        blob = native.get(key)
        if not blob:
            return None
        try:
            return decode_page(blob, digest, self.max_page_bytes)
        except PageCorrupt:
            code = native.remove(key, True)
            if code not in (0, _OBJECT_NOT_FOUND):
                logger.warning("mooncake page store: could not remove corrupt %s (%d)", key, code)
            raise

    def _remove_all(self, native: _Native, digests: list[bytes]) -> list[tuple[str, int]]:
        failed: list[tuple[str, int]] = []
        for digest in digests:
            code = native.remove(self._key(digest), True)
            if code not in (0, _OBJECT_NOT_FOUND):
                failed.append((self._key(digest), code))
        return failed


async def _in_thread(function: Callable[..., T], *args: Any) -> T:
    """``function`` in a worker thread; an ``OSError`` or ``RuntimeError`` from the binding
    becomes ``PageStoreError``."""
    try:
        return await asyncio.to_thread(function, *args)
    except (OSError, RuntimeError) as exc:
        raise PageStoreError(f"mooncake store call failed: {exc}") from exc
