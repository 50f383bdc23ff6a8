"""``DirectoryPageStore``: the L3 page store as one file per page in a local directory.

A page lives in ``<root>/<digest hex>`` in ``worker.hicache.stores.codec``'s self-checking format.
It is
written to a hidden temp name in the same directory (``.<digest hex>.<store token>.<n>.tmp``) and
renamed into place, so a reader sees a whole page or none. ``scan`` deletes temp files that no
live store of this process is writing (a crash's leftovers), and foreign or corrupt files.

Fsync policy (``fsync``): "never" by default, because this is a cache: a page lost to a power
cut is only recomputed, and a torn one is caught by the checksum and deleted. "page" fsyncs
every page file before its rename and the directory once per ``put``, so pages survive power
loss once ``put`` returns (at the cost of a disk flush per page).

Capacity: with ``capacity_pages`` the store keeps at most that many pages, evicting the least
recently used (put or get) and reporting the evicted headers to ``on_evict`` (after deleting
their files; a put of a page being evicted waits for that and writes it anew). The LRU order is
in memory; ``scan()``, which a restarted worker runs before anything else, rebuilds it from the
files' mtimes (a ``get`` touches its file's mtime so that order survives restarts): it verifies
pages newest first and deletes, unread, the files older than the first ``capacity_pages`` valid
ones. Files a store has not scanned or written are outside its LRU: not counted, not evicted.

A directory belongs to one store: another process's temp files look like a crash's leftovers to
``scan``, and its pages are outside this store's LRU (give each rank its own directory).

All file I/O runs in worker threads (``asyncio.to_thread``): a 32 MiB page costs the event loop
nothing but the hand-off. The in-memory state is touched on the event loop only, so the store is
safe for concurrent tasks on one loop, not for use from several threads or loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from worker.hicache.stores.base import (
    EvictCallback,
    FsyncPolicy,
    PageCorrupt,
    PageStoreError,
    StoredPage,
    StoredPageHeader,
)
from worker.hicache.stores.codec import encode_page, read_page

__all__ = ["DEFAULT_MAX_PAGE_BYTES", "DirectoryPageStore"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PAGE_BYTES = 64 << 20  # 16x a large real page (4 MiB): a bound, not a budget
_PAGE_NAME = re.compile(r"(?:[0-9a-f]{2}){1,64}")  # a digest's lowercase hex
_TEMP_NAME = re.compile(r"\.(?P<digest>[0-9a-f]+)\.(?P<token>[0-9a-f]+)\.\d+\.tmp")
_LIVE_TOKENS: set[str] = set()  # the stores of this process: their temp files are not leftovers

T = TypeVar("T")


class DirectoryPageStore:
    """A ``PageStore`` of one file per page under ``root`` (module docstring: format, fsync
    policy, capacity). ``root`` is created if missing."""

    def __init__(
        self,
        root: Path,
        *,
        capacity_pages: int | None = None,
        fsync: FsyncPolicy = "never",
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        on_evict: EvictCallback | None = None,
    ) -> None:
        if capacity_pages is not None and capacity_pages < 1:
            raise ValueError(f"capacity_pages must be at least 1, not {capacity_pages}")
        if fsync not in ("never", "page"):
            raise ValueError(f"fsync must be 'never' or 'page', not {fsync!r}")
        self.root = Path(root)
        self.capacity_pages = capacity_pages
        self.fsync: FsyncPolicy = fsync
        self.max_page_bytes = max_page_bytes
        self._on_evict = on_evict
        self._token = uuid.uuid4().hex[:16]
        self._temp_ids = itertools.count()
        self._lru: OrderedDict[bytes, StoredPageHeader] = OrderedDict()
        self._writing: dict[bytes, asyncio.Future[None]] = {}
        self._evicting: dict[bytes, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.root.mkdir(parents=True, exist_ok=True)  # once, at start-up: not on a hot path
        _LIVE_TOKENS.add(self._token)

    def __len__(self) -> int:
        """The number of pages the LRU tracks (all stored pages once ``scan`` has run)."""
        return len(self._lru)

    async def put(self, pages: Sequence[StoredPage]) -> None:
        """Write the pages not yet stored (a stored one is only marked recently used), then
        evict beyond the capacity. Runs to completion even if the caller is cancelled, so the
        LRU always matches the files."""
        self._check_open()
        for page in pages:
            if len(page.data) > self.max_page_bytes:
                raise PageStoreError(
                    f"page {page.header.digest.hex()} has {len(page.data)} bytes of data, "
                    f"over max_page_bytes={self.max_page_bytes}"
                )
        await self._shielded(self._put(list(pages)))

    async def get(self, digest: bytes) -> StoredPage | None:
        """The verified page, or None; a corrupt file is deleted and raises ``PageCorrupt``.
        Marks a tracked page recently used (an untracked one, before ``scan``, stays so)."""
        self._check_open()
        try:
            page = await _in_thread(_read_file, self._path(digest), digest, self.max_page_bytes)
        except PageCorrupt:
            self._lru.pop(digest, None)
            raise
        if page is None:
            self._lru.pop(digest, None)  # deleted behind the store's back
        elif digest in self._lru:
            self._lru.move_to_end(digest)
        return page

    async def exists(self, digests: Sequence[bytes]) -> list[bool]:
        """Whether each digest's file is there (one thread hop for all; no integrity check)."""
        self._check_open()
        paths = [self._path(digest) for digest in digests]
        return await _in_thread(lambda: [path.is_file() for path in paths])

    async def delete(self, digests: Sequence[bytes]) -> None:
        """Delete the digests' files (no ``on_evict``: the caller knows what it deleted)."""
        self._check_open()
        for digest in digests:
            self._lru.pop(digest, None)
        await _in_thread(_unlink_all, [self._path(digest) for digest in digests])

    async def scan(self) -> AsyncIterator[StoredPageHeader]:
        """Every valid page's header, newest first, rebuilding the LRU (module docstring).
        Deletes crash-leftover temp files, foreign files, corrupt pages and, with a capacity,
        the oldest pages beyond it (these unread and not reported to ``on_evict``)."""
        self._check_open()
        names = await _in_thread(_list_pages, self.root)
        names.reverse()
        for index, name in enumerate(names):
            if self.capacity_pages is not None and len(self._lru) >= self.capacity_pages:
                await self._drop_unscanned(names[index:])
                return
            header = await self._scan_one(bytes.fromhex(name))
            if header is not None:
                yield header

    async def aclose(self) -> None:
        """Wait for the puts and evictions still running, then refuse further calls."""
        self._closed = True
        _LIVE_TOKENS.discard(self._token)
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    # -- internals, on the event loop --------------------------------------------------------
    #
    # A digest is in at most one of: ``_writing`` (a put is writing it), ``_lru`` (stored),
    # ``_evicting`` (its file is being deleted); a put waits out the first and the last, so
    # two operations never race on one file.

    def _check_open(self) -> None:
        if self._closed:
            raise PageStoreError(f"page store {self.root} is closed")

    def _path(self, digest: bytes) -> Path:
        return self.root / digest.hex()

    async def _shielded(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` as a task that a cancelled caller does not cancel."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _put(self, pages: list[StoredPage]) -> None:
        digests = {page.header.digest for page in pages}
        while busy := self._busy_with(digests):
            await asyncio.wait(busy)
        fresh: dict[bytes, StoredPage] = {}
        for page in pages:
            digest = page.header.digest
            if digest in self._lru:
                self._lru.move_to_end(digest)  # stored already: only a use
            else:
                fresh.setdefault(digest, page)
        if fresh:
            await self._write(list(fresh.values()))
        await self._evict_over_capacity()

    def _busy(self, digest: bytes) -> asyncio.Future[None] | None:
        """The write or eviction of ``digest`` in flight, if any."""
        return self._writing.get(digest) or self._evicting.get(digest)

    def _busy_with(self, digests: set[bytes]) -> set[asyncio.Future[None]]:
        return {busy for digest in digests if (busy := self._busy(digest)) is not None}

    async def _write(self, pages: list[StoredPage]) -> None:
        """Write ``pages`` (none of them stored) and track them as most recently used."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for page in pages:
            self._writing[page.header.digest] = done
        jobs = [(page, self._path(page.header.digest), self._temp_path(page)) for page in pages]
        try:
            await _in_thread(_write_pages, jobs, self.root, self.fsync == "page")
            for page in pages:
                self._lru[page.header.digest] = page.header
                self._lru.move_to_end(page.header.digest)
        finally:
            for page in pages:
                del self._writing[page.header.digest]
            done.set_result(None)

    def _temp_path(self, page: StoredPage) -> Path:
        return self.root / f".{page.header.digest.hex()}.{self._token}.{next(self._temp_ids)}.tmp"

    async def _scan_one(self, digest: bytes) -> StoredPageHeader | None:
        """Verify one page file and track it as older than every tracked page."""
        if digest in self._lru:  # put by this store meanwhile
            return self._lru[digest]
        if self._busy(digest) is not None:
            return None
        name = digest.hex()
        try:
            page = await _in_thread(
                _read_file, self.root / name, digest, self.max_page_bytes, touch=False
            )
        except PageCorrupt as exc:
            logger.warning("page store %s: deleted corrupt page file %s: %s", self.root, name, exc)
            return None
        if page is None or self._busy(digest) is not None or digest in self._lru:
            return None  # deleted, or put again, while it was read
        self._lru[digest] = page.header
        self._lru.move_to_end(digest, last=False)
        await self._evict_over_capacity()  # only when puts ran during the scan
        return page.header

    async def _drop_unscanned(self, names: list[str]) -> None:
        """Delete the page files older than the capacity's worth a scan kept."""
        stale = [
            self.root / name
            for name in names
            if (d := bytes.fromhex(name)) not in self._lru and self._busy(d) is None
        ]
        logger.info("page store %s: deleting %d pages over capacity", self.root, len(stale))
        await _in_thread(_unlink_all, stale)

    async def _evict_over_capacity(self) -> None:
        """Evict the least recently used pages beyond the capacity."""
        victims: list[StoredPageHeader] = []
        while self.capacity_pages is not None and len(self._lru) > self.capacity_pages:
            victims.append(self._lru.popitem(last=False)[1])
        if victims:
            await self._shielded(self._evict(victims))

    async def _evict(self, victims: list[StoredPageHeader]) -> None:
        """Delete the victims' files, report them, then let puts of the same pages proceed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for header in victims:
            self._evicting[header.digest] = done
        try:
            await _in_thread(_unlink_all, [self._path(header.digest) for header in victims])
            self._report(victims)
        finally:
            for header in victims:
                if self._evicting.get(header.digest) is done:
                    del self._evicting[header.digest]
            done.set_result(None)

    def _report(self, victims: list[StoredPageHeader]) -> None:
        if self._on_evict is None:
            return
        try:
            self._on_evict(victims)
        except Exception:  # the callback's bug must not fail the put that evicted
            logger.exception("page store %s: on_evict failed", self.root)


async def _in_thread(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function`` in a worker thread; an ``OSError`` becomes ``PageStoreError``."""
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except OSError as exc:
        raise PageStoreError(f"page store I/O failed: {exc}") from exc


# -- blocking file work, in worker threads ----------------------------------------------------


def _write_pages(jobs: list[tuple[StoredPage, Path, Path]], root: Path, fsync: bool) -> None:
    """Write each page not already stored: temp file, optional fsync, rename; then the
    directory's fsync when asked."""
    wrote = False
    for page, path, temp in jobs:
        if path.exists():
            continue
        head, data = encode_page(page)
        try:
            with open(temp, "xb") as file:
                file.write(head)
                file.write(data)
                if fsync:
                    file.flush()
                    os.fsync(file.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        wrote = True
    if fsync and wrote:
        _fsync_directory(root)


def _fsync_directory(root: Path) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(
    path: Path, digest: bytes, max_page_bytes: int, *, touch: bool = True
) -> StoredPage | None:
    """The verified page at ``path`` (None when absent); deletes it and raises ``PageCorrupt``
    when it fails. ``touch`` sets its mtime to now, the LRU order a restart rebuilds."""
    try:
        with open(path, "rb") as file:
            page = read_page(file.read, digest, max_page_bytes)
    except FileNotFoundError:  # only open() raises it
        return None
    except PageCorrupt:
        path.unlink(missing_ok=True)
        raise
    if touch:
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
    return page


def _unlink_all(paths: list[Path]) -> None:
    """Delete ``paths``, best effort: a file that cannot be deleted is logged and skipped."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("page store: could not delete %s: %s", path, exc)


def _list_pages(root: Path) -> list[str]:
    """The page file names under ``root``, oldest mtime first; removes crash-leftover temp files
    and foreign files on the way (a directory or link is left alone, with a warning)."""
    pages: list[tuple[int, str]] = []
    with os.scandir(root) as entries:
        for entry in entries:
            kept = _classify(root, entry)
            if kept is not None:
                pages.append((kept, entry.name))
    pages.sort()
    return [name for _, name in pages]


def _classify(root: Path, entry: os.DirEntry[str]) -> int | None:
    """A page file's mtime (ns), or None after dealing with anything else in the directory."""
    temp = _TEMP_NAME.fullmatch(entry.name)
    if temp is not None:
        if temp["token"] not in _LIVE_TOKENS:
            logger.info("page store %s: removing leftover temp file %s", root, entry.name)
            _unlink_all([Path(entry.path)])
        return None
    if not entry.is_file(follow_symlinks=False):
        logger.warning("page store %s: ignoring %s (not a regular file)", root, entry.name)
        return None
    if _PAGE_NAME.fullmatch(entry.name) is None:
        logger.warning("page store %s: deleted foreign file %s", root, entry.name)
        _unlink_all([Path(entry.path)])
        return None
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except FileNotFoundError:
        return None
