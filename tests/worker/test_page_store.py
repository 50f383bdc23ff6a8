"""The L3 page stores: ``DirectoryPageStore`` on real files in tmp_path, ``MooncakePageStore``
against a real ``mooncake_master`` on loopback, and ``open_page_store``."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.mooncake_master import MooncakeMaster, MooncakeMissing
from testkit.polling import await_until
from worker.hicache.stores import open_page_store
from worker.hicache.stores.base import PageCorrupt, PageStoreError, StoredPage, StoredPageHeader
from worker.hicache.stores.codec import PREFIX, decode_page, encode_page
from worker.hicache.stores.directory import DirectoryPageStore
from worker.hicache.stores.mooncake import MooncakePageStore

PAGE_TOKENS = 4


def _page(i: int, size: int = 4096) -> StoredPage:
    """Page ``i`` of one chained prompt, ``size`` bytes of KV that differ from page to page."""
    digest = hashlib.sha256(f"page-{i}".encode()).digest()
    parent = hashlib.sha256(f"page-{i - 1}".encode()).digest() if i > 0 else None
    header = StoredPageHeader(
        digest=digest,
        event_id=int.from_bytes(digest[:8], "big", signed=True),
        parent_digest=parent,
        parent_event_id=None if parent is None else int.from_bytes(parent[:8], "big", signed=True),
        position=i,
        token_ids=tuple(range(i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS)),
    )
    data = hashlib.shake_256(digest).digest(size) if size else b""
    return StoredPage(header, data)


def _file(root: Path, page: StoredPage) -> Path:
    return root / page.header.digest.hex()


def _files(root: Path) -> set[str]:
    return {path.name for path in root.iterdir()}


async def _scan(store: DirectoryPageStore) -> list[StoredPageHeader]:
    return [header async for header in store.scan()]


# -- the codec ----------------------------------------------------------------------------------


def test_the_codec_round_trips_and_checks_every_part() -> None:
    page = _page(3, 1000)
    head, data = encode_page(page)
    blob = head + data
    assert decode_page(blob, page.header.digest, 1 << 20) == page
    # a flipped bit in the prefix, the header or the data; a short or a long value
    for index in (PREFIX.size - 1, PREFIX.size + 5, len(blob) - 1):
        garbled = bytearray(blob)
        garbled[index] ^= 0x01
        with pytest.raises(PageCorrupt):
            decode_page(bytes(garbled), page.header.digest, 1 << 20)
    for wrong in (blob[:-1], blob + b"\0", blob[: PREFIX.size - 1], b""):
        with pytest.raises(PageCorrupt):
            decode_page(wrong, page.header.digest, 1 << 20)
    with pytest.raises(PageCorrupt, match="holds page"):
        decode_page(blob, _page(4).header.digest, 1 << 20)
    with pytest.raises(PageCorrupt, match="over the limit"):
        decode_page(blob, page.header.digest, 999)


# -- the directory backend ----------------------------------------------------------------------


async def test_pages_round_trip_through_files(tmp_path: Path) -> None:
    store = DirectoryPageStore(tmp_path)
    pages = [_page(0), _page(1, 0), _page(2, 100_000)]
    await store.put(pages)
    assert _files(tmp_path) == {p.header.digest.hex() for p in pages}
    for page in pages:
        assert await store.get(page.header.digest) == page
    absent = _page(9).header.digest
    assert await store.get(absent) is None
    assert await store.exists([pages[1].header.digest, absent]) == [True, False]
    await store.delete([pages[1].header.digest, absent])
    assert await store.get(pages[1].header.digest) is None
    assert await store.exists([p.header.digest for p in pages]) == [True, False, True]
    await store.aclose()
    with pytest.raises(PageStoreError, match="closed"):
        await store.get(pages[0].header.digest)


async def test_a_stored_digest_is_left_as_it_is(tmp_path: Path) -> None:
    store = DirectoryPageStore(tmp_path)
    first = _page(0)
    await store.put([first])
    await store.put([StoredPage(first.header, b"other bytes")])
    assert await store.get(first.header.digest) == first
    await store.aclose()


async def test_a_failed_write_leaves_neither_page_nor_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DirectoryPageStore(tmp_path)

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(PageStoreError, match="No space left"):
        await store.put([_page(0)])
    assert _files(tmp_path) == set()
    assert len(store) == 0
    await store.aclose()


async def test_scan_removes_a_crash_leftover_temp_file(tmp_path: Path) -> None:
    store = DirectoryPageStore(tmp_path)
    page = _page(0)
    await store.put([page])
    head, data = encode_page(_page(1))
    # what a killed writer leaves: half a page under a temp name of a store that no longer runs
    leftover = tmp_path / f".{_page(1).header.digest.hex()}.0123abcd.7.tmp"
    leftover.write_bytes((head + data)[:100])
    assert [h.digest for h in await _scan(store)] == [page.header.digest]
    assert _files(tmp_path) == {page.header.digest.hex()}
    await store.aclose()


@pytest.mark.parametrize(
    "damage",
    ["flip a data byte", "flip a header byte", "truncate", "append", "garbage", "empty"],
)
async def test_a_damaged_file_is_reported_corrupt_and_deleted(tmp_path: Path, damage: str) -> None:
    store = DirectoryPageStore(tmp_path)
    page, other = _page(0, 10_000), _page(1)
    await store.put([page, other])
    path = _file(tmp_path, page)
    blob = bytearray(path.read_bytes())
    if damage == "flip a data byte":
        blob[-5000] ^= 0x40
    elif damage == "flip a header byte":
        blob[PREFIX.size + 3] ^= 0x01
    elif damage == "truncate":
        del blob[-1:]
    elif damage == "append":
        blob += b"\0"
    elif damage == "garbage":
        blob = bytearray(os.urandom(len(blob)))
    else:
        blob = bytearray()
    path.write_bytes(bytes(blob))
    with pytest.raises(PageCorrupt):
        await store.get(page.header.digest)
    assert not path.exists()
    assert await store.get(page.header.digest) is None
    assert await store.get(other.header.digest) == other  # the neighbour is untouched
    assert len(store) == 1
    await store.aclose()


async def test_another_pages_file_under_a_wrong_name_is_corrupt(tmp_path: Path) -> None:
    store = DirectoryPageStore(tmp_path)
    page, victim = _page(0), _page(1)
    await store.put([page])
    _file(tmp_path, victim).write_bytes(_file(tmp_path, page).read_bytes())
    with pytest.raises(PageCorrupt, match="holds page"):
        await store.get(victim.header.digest)
    assert not _file(tmp_path, victim).exists()
    assert await store.get(page.header.digest) == page
    await store.aclose()


async def test_capacity_evicts_the_least_recently_used_and_reports_it(tmp_path: Path) -> None:
    evicted: list[list[StoredPageHeader]] = []
    store = DirectoryPageStore(tmp_path, capacity_pages=3, on_evict=evicted.append)
    pages = [_page(i) for i in range(6)]
    await store.put(pages[:3])
    assert evicted == []
    assert await store.get(pages[0].header.digest) == pages[0]  # 0 is now the most recent
    await store.put([pages[1]])  # re-putting a stored page counts as a use too
    await store.put([pages[3]])
    assert evicted == [[pages[2].header]]
    await store.put(pages[4:6])
    assert evicted == [[pages[2].header], [pages[0].header, pages[1].header]]
    assert _files(tmp_path) == {p.header.digest.hex() for p in pages[3:6]}
    assert len(store) == 3
    await store.aclose()


async def test_an_evicted_page_put_again_is_stored_again(tmp_path: Path) -> None:
    evicted: list[StoredPageHeader] = []
    store = DirectoryPageStore(tmp_path, capacity_pages=1, on_evict=evicted.extend)
    first, second = _page(0), _page(1)
    await store.put([first])
    await asyncio.gather(store.put([second]), store.put([first]))
    await store.put([first])
    assert await store.get(first.header.digest) == first
    assert await store.exists([first.header.digest]) == [True]
    assert len(store) == 1
    assert evicted[-1] == second.header
    await store.aclose()


async def test_a_cancelled_put_still_lands_in_the_index(tmp_path: Path) -> None:
    store = DirectoryPageStore(tmp_path, capacity_pages=2)
    page = _page(0, 8 << 20)
    task = asyncio.create_task(store.put([page]))
    await asyncio.sleep(0)  # let the put start its write
    task.cancel()
    await store.aclose()  # waits for the write it shielded
    assert len(store) == 1
    assert _files(tmp_path) == {page.header.digest.hex()}


async def test_a_restarted_store_scans_every_page_and_rebuilds_its_lru(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = DirectoryPageStore(tmp_path)
    pages = [_page(i) for i in range(5)]
    await first.put(pages)
    await first.aclose()
    # mtimes say: page 4 oldest, then 0, 1, 2, 3
    base = time.time() - 100
    for rank, page in enumerate([pages[4], *pages[:4]]):
        os.utime(_file(tmp_path, page), (base + rank, base + rank))
    (tmp_path / "notes.txt").write_text("not a page")
    (tmp_path / _page(7).header.digest.hex()).write_bytes(b"PDKV torn")
    (tmp_path / "subdir").mkdir()

    evicted: list[StoredPageHeader] = []
    second = DirectoryPageStore(tmp_path, capacity_pages=5, on_evict=evicted.extend)
    with caplog.at_level(logging.WARNING, logger="worker.hicache.stores.directory"):
        headers = await _scan(second)
    assert headers == [*(p.header for p in reversed(pages[:4])), pages[4].header]  # newest first
    assert _files(tmp_path) == {p.header.digest.hex() for p in pages} | {"subdir"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    assert sum("notes.txt" in w for w in warnings) == 1
    assert sum(_page(7).header.digest.hex() in w for w in warnings) == 1
    # the rebuilt LRU evicts by mtime: page 4 first
    await second.put([_page(5)])
    assert evicted == [pages[4].header]
    await second.aclose()


async def test_a_restart_with_a_smaller_capacity_keeps_the_newest(tmp_path: Path) -> None:
    first = DirectoryPageStore(tmp_path)
    pages = [_page(i) for i in range(4)]
    await first.put(pages)
    await first.aclose()
    base = time.time() - 100
    for rank, page in enumerate(pages):
        os.utime(_file(tmp_path, page), (base + rank, base + rank))
    second = DirectoryPageStore(tmp_path, capacity_pages=2)
    assert await _scan(second) == [pages[3].header, pages[2].header]
    assert _files(tmp_path) == {p.header.digest.hex() for p in pages[2:]}
    await second.aclose()


async def test_a_large_page_does_not_stall_the_event_loop(tmp_path: Path) -> None:
    store = DirectoryPageStore(tmp_path)
    page = _page(0, 32 << 20)
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    await await_until(lambda: len(gaps) >= 3, 5.0, "the ticker to run")
    await store.put([page])
    got = await store.get(page.header.digest)
    done.set()
    await ticking
    assert got == page
    assert len(gaps) > 3
    assert max(gaps) < 0.1, f"event loop stalled {max(gaps) * 1000:.0f} ms"
    await store.aclose()


async def test_an_oversize_page_is_rejected_before_anything_is_written(tmp_path: Path) -> None:
    store = DirectoryPageStore(tmp_path, max_page_bytes=1024)
    with pytest.raises(PageStoreError, match="max_page_bytes"):
        await store.put([_page(0, 1024), _page(1, 1025)])
    assert _files(tmp_path) == set()
    await store.put([_page(0, 1024)])
    assert await store.get(_page(0).header.digest) == _page(0, 1024)
    await store.aclose()


async def test_fsync_page_syncs_each_file_and_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    never = DirectoryPageStore(tmp_path / "never")
    await never.put([_page(0)])
    assert synced == []
    store = DirectoryPageStore(tmp_path / "page", fsync="page")
    await store.put([_page(0), _page(1)])
    root = str(tmp_path / "page")
    temps = [p for p in synced if p != root]
    assert len(temps) == 2 and all(Path(p).name.endswith(".tmp") for p in temps)
    assert synced[-1] == root
    assert await store.get(_page(1).header.digest) == _page(1)
    await never.aclose()
    await store.aclose()


# -- open_page_store ----------------------------------------------------------------------------


async def test_open_page_store_picks_the_backend_by_name(tmp_path: Path) -> None:
    evicted: list[StoredPageHeader] = []
    store = open_page_store("file", directory=tmp_path, capacity_pages=1, on_evict=evicted.extend)
    assert isinstance(store, DirectoryPageStore)
    await store.put([_page(0)])
    await store.put([_page(1)])
    assert evicted == [_page(0).header]
    await store.aclose()
    with pytest.raises(PageStoreError, match="unknown page store backend 'disk'"):
        open_page_store("disk", directory=tmp_path)
    with pytest.raises(PageStoreError, match="directory"):
        open_page_store("file")
    with pytest.raises(PageStoreError, match="master"):
        open_page_store("mooncake")


# -- the Mooncake backend -----------------------------------------------------------------------

MOONCAKE_PLATFORM = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[MooncakeMaster]:
    if not MOONCAKE_PLATFORM:
        pytest.skip("the mooncake wheel is a dependency on x86_64 Linux only")
    master = MooncakeMaster()
    try:
        master.start()
    except MooncakeMissing as exc:  # fail, never skip where it is a dependency
        master.close()
        pytest.fail(str(exc), pytrace=False)
    yield master
    master.close()


def _mooncake_store(
    master: MooncakeMaster, *, key_prefix: str = "", metadata_server: str = "P2PHANDSHAKE"
) -> MooncakePageStore:
    """A small client: 64 MiB of segment, 16 MiB of staging buffer, pages up to 8 MiB."""
    return MooncakePageStore(
        master.address,
        metadata_server=metadata_server,
        key_prefix=key_prefix,
        global_segment_bytes=64 << 20,
        local_buffer_bytes=16 << 20,
        max_page_bytes=8 << 20,
    )


async def test_mooncake_pages_round_trip_between_two_clients(
    mooncake_master: MooncakeMaster,
) -> None:
    writer = _mooncake_store(mooncake_master, key_prefix="rt/")
    reader = _mooncake_store(mooncake_master, key_prefix="rt/")
    pages = [_page(0), _page(1, 4 << 20), _page(2, 0)]
    await writer.put(pages)
    await writer.put([StoredPage(pages[0].header, b"other bytes")])  # left as it is
    for page in pages:
        assert await reader.get(page.header.digest) == page
    absent = _page(9).header.digest
    assert await reader.get(absent) is None
    assert await reader.exists([pages[0].header.digest, absent]) == [True, False]
    await reader.delete([pages[0].header.digest, absent])
    assert await writer.exists([p.header.digest for p in pages]) == [False, True, True]
    assert [h async for h in reader.scan()] == []
    with pytest.raises(PageStoreError, match="max_page_bytes"):
        await writer.put([_page(3, (8 << 20) + 1)])
    await reader.aclose()
    await writer.aclose()


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
async def test_mooncake_key_prefixes_keep_stores_apart(mooncake_master: MooncakeMaster) -> None:
    rank0 = _mooncake_store(mooncake_master, key_prefix="m/rank0/")
    rank1 = _mooncake_store(mooncake_master, key_prefix="m/rank1/")
    await rank0.put([_page(0)])
    assert await rank1.get(_page(0).header.digest) is None
    assert await rank0.get(_page(0).header.digest) == _page(0)
    await rank1.aclose()
    await rank0.aclose()


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
async def test_mooncake_over_the_http_metadata_server_detects_corrupt_values(
    mooncake_master: MooncakeMaster,
) -> None:
    raw_store: Any = importlib.import_module("mooncake.store").MooncakeDistributedStore
    store = _mooncake_store(mooncake_master, metadata_server=mooncake_master.metadata_url)
    await store.connect()
    raw = raw_store()  # a second client, to put bytes that are not a valid page
    setup = raw.setup(
        "127.0.0.1", mooncake_master.metadata_url, 16 << 20, 16 << 20, "tcp", "",
        mooncake_master.address,
    )  # fmt: skip
    assert setup == 0
    page, wrong_name, flipped = _page(0), _page(1), _page(2)
    head, data = encode_page(page)
    blob = head + data
    garbled = bytearray(encode_page(flipped)[0] + flipped.data)
    garbled[-1] ^= 0x01
    for key, value in ((wrong_name, blob), (flipped, bytes(garbled))):
        assert await asyncio.to_thread(raw.put, key.header.digest.hex(), value) == 0
    for victim in (wrong_name, flipped):
        with pytest.raises(PageCorrupt):
            await store.get(victim.header.digest)
        assert await store.exists([victim.header.digest]) == [False]
        assert await store.get(victim.header.digest) is None
    await asyncio.to_thread(raw.close)
    await store.aclose()
