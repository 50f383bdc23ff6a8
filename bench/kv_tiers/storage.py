"""Part 3 of ``bench.kv_tiers``: prefetch throughput of the directory page store against the
disk's raw sequential read speed, measured in the same run on the same filesystem.

* prefetch: ``N`` pages (``page_bytes`` each) are put into a ``DirectoryPageStore`` (batches of
  ``worker.hicache.storage_tier.BATCH_PAGES``, as the L3 writer does), flushed (``os.sync``) and
  evicted from the page cache (``posix_fadvise(DONTNEED)`` on every page file); then read back
  the way the controller's prefetch (``worker.hicache.fetch.TierFetch._prefetch_run``) reads
  them: through ``StorageTier.read`` (the store's verified ``get`` in a worker thread, plus the
  storage link, uncapped here), ``worker.hicache.fetch.PREFETCH_DEPTH`` reads in flight, in order
  (the L2 insert that follows each read, a memcpy and a CRC-32, is not included). ``depth 1``
  (one read at a time) is shown beside it;
* page files, plain read: the same page files, evicted again, each read whole (open, read,
  close) with nothing else: what the one-file-per-page layout costs before any checksum;
* raw: one file of the same total size, written in 4 MiB chunks, fsynced, evicted the same way,
  read sequentially in 4 MiB chunks (``readinto``);
* warm: both again without evicting (page-cache speed);
* checksum: ``worker.hicache.stores.codec.page_checksum`` (CRC-32) alone over the same bytes in
  memory, page by page: the part of a prefetch that is CPU, not disk.

The target: cold prefetch (the controller's depth) >= 70% of cold raw. When it misses, the
report says whether the checksum explains it (the prefetch's time without the hash time would
reach it).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from worker.hicache.fetch import PREFETCH_DEPTH
from worker.hicache.metrics import TierMetrics
from worker.hicache.storage_tier import BATCH_PAGES, StorageTier
from worker.hicache.stores.base import StoredPage, StoredPageHeader
from worker.hicache.stores.codec import page_checksum
from worker.hicache.stores.directory import DirectoryPageStore

__all__ = ["TARGET", "StorageConfig", "StorageResult", "run_storage"]

TARGET = 0.70
CHUNK = 4 << 20
MiB = float(1 << 20)


@dataclass(frozen=True)
class StorageConfig:
    page_bytes: int = 512 << 10  # pd-worker's default shape: 16 tokens x 8 layers x 4 KiB
    total_bytes: int = 1 << 30
    page_size: int = 16
    directory: Path | None = None  # default: a temporary directory under $TMPDIR

    @property
    def pages(self) -> int:
        return max(1, self.total_bytes // self.page_bytes)


@dataclass(frozen=True)
class StorageResult:
    config: StorageConfig
    filesystem: str
    bytes_read: int
    mib_s: dict[str, float]  # "prefetch cold", "prefetch warm", "prefetch cold depth 1",
    # "raw cold", "raw warm", "checksum"
    prefetch_cold_s: float
    hash_s: float
    ratio: float  # prefetch cold / raw cold
    warm_ratio: float
    passed: bool
    verdict: str


def _drop_cache(paths: Sequence[Path]) -> None:
    """Flush everything, then drop ``paths`` from the page cache (clean pages only go)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(action: Callable[[], object]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def _write_raw(path: Path, total: int) -> None:
    block = os.urandom(CHUNK)
    with open(path, "wb") as file:
        left = total
        while left > 0:
            left -= file.write(block[: min(CHUNK, left)])
        file.flush()
        os.fsync(file.fileno())


def _read_raw(path: Path) -> int:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    done = 0
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(view):
            done += count
    return done


def _read_files(paths: Sequence[Path]) -> int:
    """Each file whole, one after the other (open, read, close): the page files' I/O alone."""
    done = 0
    for path in paths:
        with open(path, "rb") as file:
            done += len(file.read())
    return done


def _pages(cfg: StorageConfig) -> list[StoredPage]:
    base = os.urandom(cfg.page_bytes)
    pages = []
    parent: bytes | None = None
    for index in range(cfg.pages):
        digest = hashlib.sha256(f"kv-tiers-bench:{index}".encode()).digest()
        header = StoredPageHeader(
            digest=digest,
            event_id=int.from_bytes(digest[:8], "big", signed=True),
            parent_digest=parent,
            parent_event_id=None,
            position=index,
            token_ids=tuple(range(cfg.page_size)),
        )
        pages.append(StoredPage(header, index.to_bytes(8, "little") + base[8:]))
        parent = digest
    return pages


def _hash_s(page_bytes: int, pages: int) -> float:
    data = os.urandom(page_bytes)

    def run() -> None:
        for _ in range(pages):
            page_checksum(64, len(data), bytes(64), data)

    return _timed(run)


async def _prefetch(tier: StorageTier, digests: Sequence[bytes], depth: int) -> float:
    """Read every page through ``tier.read`` with ``depth`` reads in flight; seconds."""
    queue = iter(digests)
    missing: list[bytes] = []

    async def reader() -> None:
        for digest in queue:
            if await tier.read(digest) is None:
                missing.append(digest)

    began = time.perf_counter()
    await asyncio.gather(*(reader() for _ in range(depth)))
    elapsed = time.perf_counter() - began
    if missing:
        raise RuntimeError(f"{len(missing)} pages did not read back")
    return elapsed


async def _store_side(cfg: StorageConfig, root: Path) -> dict[str, float]:
    """Put the pages, then the cold, warm and depth-1 cold prefetch times (seconds)."""
    store = DirectoryPageStore(root)
    families = TierMetrics(CollectorRegistry(), "bench", "dp_rank")
    tier = StorageTier(
        store,
        page_bytes=cfg.page_bytes,
        page_size=cfg.page_size,
        bandwidth=0.0,
        metrics=families.rank(0),
        emit=lambda _events: None,
        corrupt=lambda _tier, _digest, _error: None,
    )
    try:
        pages = _pages(cfg)
        for first in range(0, len(pages), BATCH_PAGES):
            await store.put(pages[first : first + BATCH_PAGES])
        digests = [page.header.digest for page in pages]
        del pages
        files = [root / digest.hex() for digest in digests]
        times = {}
        await asyncio.to_thread(_drop_cache, files)
        times["prefetch cold"] = await _prefetch(tier, digests, PREFETCH_DEPTH)
        times["prefetch warm"] = await _prefetch(tier, digests, PREFETCH_DEPTH)
        await asyncio.to_thread(_drop_cache, files)
        times["prefetch cold depth 1"] = await _prefetch(tier, digests, 1)
        return times
    finally:
        await store.aclose()


def _filesystem(path: Path) -> str:
    """The mount (device, type) holding ``path``, from /proc/self/mounts."""
    best = ("?", "?", "")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "?"
    resolved = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and resolved.startswith(parts[1]) and len(parts[1]) > len(best[2]):
            best = (parts[0], parts[2], parts[1])
    return f"{best[0]} ({best[1]}) mounted on {best[2]}"


def _verdict(ratio: float, prefetch_s: float, hash_s: float, raw_s: float) -> str:
    if ratio >= TARGET:
        return f"PASS: cold prefetch at {ratio:.0%} of the raw sequential read (target >= 70%)"
    without = raw_s / max(prefetch_s - hash_s, 1e-9)
    share = hash_s / prefetch_s if prefetch_s > 0 else 0.0
    cause = (
        f"the checksum explains it: CRC-32 alone takes {hash_s * 1e3:.0f} ms of the "
        f"{prefetch_s * 1e3:.0f} ms ({share:.0%}); without it the prefetch would be at "
        f"{without:.0%}"
        if without >= TARGET
        else f"not the checksum alone: CRC-32 takes {hash_s * 1e3:.0f} ms of "
        f"{prefetch_s * 1e3:.0f} ms ({share:.0%}), the rest would still be at {without:.0%}"
    )
    return f"FAIL: cold prefetch at {ratio:.0%} of the raw sequential read (target >= 70%); {cause}"


def run_storage(cfg: StorageConfig) -> StorageResult:
    """Both measurements in one temporary directory (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="kv-tiers-disk-", dir=cfg.directory) as tmp:
        root = Path(tmp)
        raw = root / "raw.bin"
        total = cfg.pages * cfg.page_bytes
        _write_raw(raw, total)
        _drop_cache([raw])
        raw_cold = _timed(lambda: _read_raw(raw))
        raw_warm = _timed(lambda: _read_raw(raw))
        raw.unlink()
        times = asyncio.run(_store_side(cfg, root / "pages"))
        files = sorted((root / "pages").iterdir())
        _drop_cache(files)
        times["page files cold, plain read"] = _timed(lambda: _read_files(files))
        hash_s = _hash_s(cfg.page_bytes, cfg.pages)
        filesystem = _filesystem(root)
    speeds = {name: total / MiB / seconds for name, seconds in times.items()}
    speeds["raw cold"] = total / MiB / raw_cold
    speeds["raw warm"] = total / MiB / raw_warm
    speeds["checksum"] = total / MiB / hash_s
    ratio = speeds["prefetch cold"] / speeds["raw cold"]
    return StorageResult(
        config=cfg,
        filesystem=filesystem,
        bytes_read=total,
        mib_s=speeds,
        prefetch_cold_s=times["prefetch cold"],
        hash_s=hash_s,
        ratio=ratio,
        warm_ratio=speeds["prefetch warm"] / speeds["raw warm"],
        passed=ratio >= TARGET,
        verdict=_verdict(ratio, times["prefetch cold"], hash_s, raw_cold),
    )
