"""The tiered cache's parts on their own: the L2 host pool, layer-by-layer loading, the modelled
links and rate limit, the configuration, and the L3 wrapper over a tiny in-memory page store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
from prometheus_client import CollectorRegistry

from testkit.polling import await_until
from transfer.events import BlockRemoved, BlockStored, KVEvent
from worker.hicache.config import TierConfig
from worker.hicache.costs import Link, TokenBucket
from worker.hicache.host_pool import HostPool
from worker.hicache.layer_loading import LayerLoad, run_layers, simulate_forward
from worker.hicache.metrics import TierMetrics
from worker.hicache.storage_tier import StorageTier
from worker.hicache.stores.base import PageCorrupt, StoredPage, StoredPageHeader


def _header(n: int, parent: int | None = None) -> StoredPageHeader:
    return StoredPageHeader(
        digest=bytes([n]) * 32,
        event_id=n,
        parent_digest=None if parent is None else bytes([parent]) * 32,
        parent_event_id=parent,
        position=0 if parent is None else 1,
        token_ids=(n,) * 4,
    )


def _filled(byte: int) -> Callable[[memoryview], None]:
    def fill(view: memoryview) -> None:
        view[:] = bytes([byte]) * len(view)

    return fill


# --- the host pool ----------------------------------------------------------------------------


def test_the_host_pool_evicts_least_recently_used_unpinned_pages_bytes_intact() -> None:
    evicted: list[tuple[int, bytes]] = []
    pool = HostPool(2, 8, on_evict=lambda h, data: evicted.append((h.event_id, bytes(data))))
    assert pool.put(_header(1), _filled(1)) and pool.put(_header(2), _filled(2))
    pool.touch(_header(1).digest)
    assert pool.put(_header(3), _filled(3))
    assert evicted == [(2, b"\x02" * 8)]  # the bytes as they were, before the slot's reuse
    pinned = pool.pin(_header(1).digest)
    assert pinned is not None
    assert pool.put(_header(4), _filled(4))
    assert [e[0] for e in evicted] == [2, 3]  # 1 is pinned
    assert pool.pin(_header(4).digest) is not None  # every page pinned now
    assert pool.put(_header(5), _filled(5)) is None
    pool.unpin(pinned)
    assert pool.put(_header(5), _filled(5))
    assert [e[0] for e in evicted] == [2, 3, 1]


def test_a_host_page_that_changed_fails_its_check_and_leaves() -> None:
    pool = HostPool(2, 8)
    page = pool.put(_header(1), _filled(1))
    assert page is not None
    pool.pin(_header(1).digest)
    pool.verify(page)
    pool.data[page.slot * 8 + 3] ^= 1
    with pytest.raises(PageCorrupt):
        pool.verify(page)
    assert _header(1).digest not in pool
    assert pool.put(_header(2), _filled(2)) is not None
    assert pool.pin(_header(2).digest) is not None
    assert pool.put(_header(3), _filled(3)) is None  # the removed page still holds its slot
    pool.unpin(page)  # its slot comes back only now
    assert pool.put(_header(3), _filled(3)) is not None


# --- layer-by-layer loading -------------------------------------------------------------------


async def test_a_layer_is_waited_for_alone() -> None:
    load = LayerLoad(4)
    waiter = asyncio.create_task(load.wait(2))
    load.mark(1)
    await asyncio.sleep(0)
    assert not waiter.done()
    load.mark(2)
    await waiter
    assert not load.complete
    load.mark(3)
    assert load.complete


async def test_a_failed_load_fails_its_waiters() -> None:
    load = LayerLoad(2)
    task = asyncio.create_task(run_layers(load, 0.0, time.monotonic() + 5, lambda _: None))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(RuntimeError, match="cancelled"):
        await load.wait(1)


@pytest.mark.parametrize(("layerwise", "low", "high"), [(True, 0.2, 0.33), (False, 0.38, 0.6)])
async def test_the_forward_pass_overlaps_the_load_layer_by_layer(
    layerwise: bool, low: float, high: float
) -> None:
    load, copied = LayerLoad(8), list[int]()
    start = time.monotonic()
    loading = asyncio.create_task(run_layers(load, start, start + 0.2, copied.append))
    await simulate_forward(0.2, 8, load, layerwise)
    elapsed = time.monotonic() - start
    await loading
    assert copied == list(range(8))
    assert low <= elapsed < high  # layerwise: about 0.2 + 0.2 / 8; else 0.2 + 0.2


# --- links and the rate limit -------------------------------------------------------------------


def test_a_link_queues_copies_behind_each_other() -> None:
    now = [10.0]
    link = Link(100.0, clock=lambda: now[0])
    assert link.reserve(50) == (10.0, 10.5)
    assert link.reserve(100) == (10.5, 11.5)  # behind the first
    assert not link.idle
    now[0] = 20.0
    assert link.idle and link.reserve(10) == (20.0, 20.1)
    assert Link(0.0, clock=lambda: 3.0).reserve(10**9) == (3.0, 3.0)  # free


async def test_the_token_bucket_paces_takers() -> None:
    bucket = TokenBucket(1000.0, 100.0)
    start = time.monotonic()
    for _ in range(4):  # the first from the full bucket, then 100 bytes every 0.1 s
        await bucket.take(100)
    assert 0.28 <= time.monotonic() - start < 0.6
    await TokenBucket(0.0, 1.0).take(10**9)  # no limit


# --- configuration ----------------------------------------------------------------------------


def test_the_tier_config_is_validated() -> None:
    assert not TierConfig().enabled and TierConfig(host_pages=1).enabled
    assert TierConfig(host_pages=1).backup_hits == 1
    assert TierConfig(host_pages=1, write_policy="write_back").backup_hits == 0
    selective = TierConfig(host_pages=1, write_policy="write_through_selective", selective_hits=4)
    assert selective.backup_hits == 4
    for bad in (
        {"host_pages": -1},
        {"host_pages": 1, "selective_hits": 0},
        {"host_pages": 1, "host_bandwidth": -1.0},
        {"storage_backend": "file", "storage_dir": "x"},  # no L2
        {"host_pages": 1, "storage_backend": "file"},  # no directory
        {"host_pages": 1, "storage_backend": "mooncake"},  # no master
    ):
        with pytest.raises(ValueError):
            TierConfig(**bad)


# --- the L3 wrapper -----------------------------------------------------------------------------


class MemoryStore:
    """A ``PageStore`` in a dict, for the L3 wrapper's own logic."""

    def __init__(self, pages: Sequence[StoredPage] = ()) -> None:
        self.pages = {page.header.digest: page for page in pages}
        self.on_put: list[StoredPageHeader] = []  # evicted during the next put

    async def put(self, pages: Sequence[StoredPage]) -> None:
        for page in pages:
            self.pages.setdefault(page.header.digest, page)

    async def get(self, digest: bytes) -> StoredPage | None:
        if digest == b"\xee" * 32:
            raise PageCorrupt("bad")
        return self.pages.get(digest)

    async def exists(self, digests: Sequence[bytes]) -> list[bool]:
        return [d in self.pages for d in digests]

    async def delete(self, digests: Sequence[bytes]) -> None:
        for digest in digests:
            self.pages.pop(digest, None)

    async def scan(self) -> AsyncIterator[StoredPageHeader]:
        for page in list(self.pages.values()):
            yield page.header

    async def aclose(self) -> None:
        pass


def _tier(store: MemoryStore, events: list[KVEvent], corrupt: list[bytes]) -> StorageTier:
    metrics = TierMetrics(CollectorRegistry(), "m", "dp_rank").rank(0)
    return StorageTier(
        store,
        page_bytes=8,
        page_size=4,
        bandwidth=0.0,
        metrics=metrics,
        emit=events.extend,
        corrupt=lambda tier, digest, exc: corrupt.append(digest),
    )


async def test_the_l3_index_follows_scan_backups_evictions_and_failed_reads() -> None:
    child = StoredPage(_header(2, parent=1), b"b" * 8)
    store = MemoryStore([child, StoredPage(_header(1), b"a" * 8)])
    events: list[KVEvent] = []
    corrupt: list[bytes] = []
    tier = _tier(store, events, corrupt)
    tier.start()
    await asyncio.wait_for(tier.scanned.wait(), 5)
    await await_until(lambda: bool(events), 5.0, "the announcement")
    announced = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in announced] == [[1, 2]]  # parents first, one chained event
    assert announced[0].medium == "DISK" and announced[0].token_ids == [1] * 4 + [2] * 4
    events.clear()
    tier.submit(StoredPage(_header(3), b"c" * 8))
    tier.submit(StoredPage(_header(4), b"x"))  # another shape: stored, refused on read
    await await_until(lambda: tier.idle, 5.0, "the backups")
    assert {3, 4} <= {h.event_id for h in tier.index.values()}
    tier.evicted([_header(1)])
    assert _header(1).digest not in tier and events[-1] == BlockRemoved([1], medium="DISK")
    assert await tier.read(_header(4).digest) is None and _header(4).digest not in store.pages
    store.pages.pop(_header(3).digest)
    assert await tier.read(_header(3).digest) is None and _header(3).digest not in tier
    tier.index[b"\xee" * 32] = _header(0xEE)
    assert await tier.read(b"\xee" * 32) is None and corrupt == [b"\xee" * 32]
    assert await tier.read(_header(2).digest) == child
    await tier.aclose()
