"""Transfer engines: one contract suite over the real Mooncake engine (TCP on 127.0.0.1) and the
loopback fake, plus what only one of them has (the per-peer limit, cancellation; failure knobs).

The two Mooncake engines live for the whole module (destroying one takes ~1 s with the GIL held),
so every async test runs on the module's event loop; buffers are registered per test.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import pytest
import pytest_asyncio

from transfer.engine.base import TransferEngine
from transfer.engine.fake import LoopbackEngine, LoopbackNetwork
from transfer.engine.mooncake import CODE_FAILED, MooncakeEngine
from transfer.engine.mooncake_batch import PeerBudget
from transfer.engine.regions import RegionTable
from transfer.errors import EngineError
from transfer.page_layout import MAX_ENTRIES_PER_BATCH, Entry, KVPageLayout, transfer_entries

pytestmark = pytest.mark.timeout(20)
module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE = 4096
BOUND_S = 5.0  # every failure must surface well within this


class Buffer:
    """Zeroed memory from ctypes, addressed by offset."""

    def __init__(self, size: int) -> None:
        self.raw = ctypes.create_string_buffer(size)
        self.size = size
        self.addr = ctypes.addressof(self.raw)

    def fill_random(self, seed: int) -> bytes:
        data = random.Random(seed).randbytes(self.size)
        ctypes.memmove(self.addr, data, self.size)
        return data

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        length = self.size - offset if length is None else length
        return ctypes.string_at(self.addr + offset, length)


@dataclass
class Pair:
    """Engine ``a`` writes into engine ``b``; ``buffers`` registers fresh memory on both."""

    kind: str
    a: TransferEngine
    b: TransferEngine
    registered: list[tuple[TransferEngine, Buffer]] = field(default_factory=list)

    def buffers(self, src_size: int, dst_size: int | None = None) -> tuple[Buffer, Buffer]:
        src, dst = Buffer(src_size), Buffer(src_size if dst_size is None else dst_size)
        self.a.register(src.addr, src.size)
        self.registered.append((self.a, src))
        self.b.register(dst.addr, dst.size)
        self.registered.append((self.b, dst))
        return src, dst

    def unregister_all(self) -> None:
        for engine, buffer in self.registered:
            engine.unregister(buffer.addr)

    def in_flight(self) -> int:
        """Entries ``a`` has in flight to ``b`` (Mooncake; the fake has none between calls)."""
        return self.a.in_flight(self.b.session_id) if isinstance(self.a, MooncakeEngine) else 0


def pages(
    src: Buffer, dst: Buffer, src_pages: Sequence[int], dst_pages: Sequence[int], size: int = PAGE
) -> list[Entry]:
    return [
        Entry(src.addr + s * size, dst.addr + d * size, size)
        for s, d in zip(src_pages, dst_pages, strict=True)
    ]


async def bounded_error(write: Awaitable[None]) -> EngineError:
    """Await ``write`` and return the ``EngineError`` it must raise within BOUND_S."""
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        async with asyncio.timeout(BOUND_S):
            await write
    assert time.monotonic() - start < BOUND_S
    return info.value


def kv_layout(base: int) -> KVPageLayout:
    return KVPageLayout.packed(
        base, num_layers=4, page_size_tokens=16, bytes_per_token_per_layer=64, num_pages=64
    )


async def eventually(predicate: Callable[[], bool], pause: float = 0.001) -> None:
    """Poll ``predicate`` until it holds (engine state has no event to wait on); BOUND_S at most."""
    async with asyncio.timeout(BOUND_S):
        while True:
            if predicate():
                return
            await asyncio.sleep(pause)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mooncake_engines() -> AsyncIterator[tuple[MooncakeEngine, MooncakeEngine]]:
    a, b = await asyncio.gather(MooncakeEngine.start(), MooncakeEngine.start())
    yield a, b
    await asyncio.gather(a.close(), b.close())


@pytest_asyncio.fixture(loop_scope="module", params=["loopback", "mooncake"])
async def pair(
    request: pytest.FixtureRequest, mooncake_engines: tuple[MooncakeEngine, MooncakeEngine]
) -> AsyncIterator[Pair]:
    # The annotation makes mypy check both implementations against the Protocol.
    if request.param == "mooncake":
        engines: tuple[TransferEngine, TransferEngine] = mooncake_engines
    else:
        network = LoopbackNetwork()
        engines = (network.engine(), network.engine())
    result = Pair(request.param, *engines)
    yield result
    result.unregister_all()
    if request.param == "loopback":
        await asyncio.gather(result.a.close(), result.b.close())


async def peer_engine(kind: str, pair: Pair) -> TransferEngine:
    """A third engine reachable from ``pair.a``, to be closed by the test."""
    if kind == "mooncake":
        return await MooncakeEngine.start()
    assert isinstance(pair.a, LoopbackEngine)
    return pair.a._network.engine()


# ------------------------------------------------------------------ contract: both engines


@module_loop
async def test_pages_land_at_their_destinations(pair: Pair) -> None:
    src, dst = pair.buffers(64 * PAGE, 128 * PAGE)
    data = src.fill_random(1)
    dst_pages = [127 - 2 * i for i in range(64)]  # scattered, reversed: nothing coalesces
    await pair.a.write(pair.b.session_id, pages(src, dst, range(64), dst_pages))
    for s, d in enumerate(dst_pages):
        assert dst.read(d * PAGE, PAGE) == data[s * PAGE : (s + 1) * PAGE]
    untouched = set(range(128)) - set(dst_pages)
    assert all(dst.read(p * PAGE, PAGE) == bytes(PAGE) for p in untouched)
    assert pair.in_flight() == 0


@module_loop
async def test_coalesced_kv_layout_write(pair: Pair) -> None:
    src, dst = pair.buffers(kv_layout(0).total_bytes)
    data = src.fill_random(2)
    src_layout, dst_layout = kv_layout(src.addr), kv_layout(dst.addr)
    src_pages = [*range(32), 40, 41, 50]
    dst_pages = [*range(10, 42), 60, 61, 0]
    entries = transfer_entries(src_layout, dst_layout, src_pages, dst_pages)
    assert len(entries) == 3 * src_layout.num_regions  # 35 pages, three runs per region
    await pair.a.write(pair.b.session_id, entries)
    for region in range(src_layout.num_regions):
        layer, value = region % 4, region >= 4
        for s, d in zip(src_pages, dst_pages, strict=True):
            offset = src_layout.offset(layer, s, value=value)
            expected = data[offset : offset + src_layout.page_bytes]
            got = dst.read(dst_layout.offset(layer, d, value=value), dst_layout.page_bytes)
            assert got == expected


@module_loop
async def test_more_entries_than_a_batch_split_and_all_land(pair: Pair) -> None:
    n, size = 2500, 1024
    src, dst = pair.buffers(n * size)
    data = src.fill_random(3)
    await pair.a.write(pair.b.session_id, pages(src, dst, range(n), range(n - 1, -1, -1), size))
    for s in range(n):
        d = n - 1 - s
        assert dst.read(d * size, size) == data[s * size : (s + 1) * size]
    if isinstance(pair.a, LoopbackEngine):
        assert pair.a.stats.batch_sizes == [1024, 1024, 452]
    assert pair.in_flight() == 0


@module_loop
async def test_unregistered_destination_fails_after_the_batch_drained(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = pair.buffers(600 * PAGE)
    stray = Buffer(PAGE)
    entries = pages(src, dst, range(600), range(600))
    entries[300] = Entry(src.addr, stray.addr, PAGE)
    with caplog.at_level(logging.WARNING, logger="transfer.engine"):
        error = await bounded_error(pair.a.write(pair.b.session_id, entries))
    assert (error.op, error.code) == ("write", CODE_FAILED)
    assert pair.in_flight() == 0  # nothing of the batch is left to land on reused pages
    assert any(
        "write failed" in r.getMessage() and pair.b.session_id in r.getMessage()
        for r in caplog.records
    )
    data = src.fill_random(4)  # the engine is still healthy
    await pair.a.write(pair.b.session_id, pages(src, dst, range(4), range(4)))
    assert dst.read(0, 4 * PAGE) == data[: 4 * PAGE]


@module_loop
async def test_unregistered_source_fails(pair: Pair) -> None:
    _, dst = pair.buffers(PAGE)
    stray = Buffer(PAGE)
    entries = [Entry(stray.addr, dst.addr, PAGE)]
    error = await bounded_error(pair.a.write(pair.b.session_id, entries))
    assert error.op == "write"
    assert error.code is not None and error.code < 0


@module_loop
async def test_unknown_session_fails(pair: Pair) -> None:
    src, dst = pair.buffers(PAGE)
    bogus = "127.0.0.1:1" if pair.kind == "mooncake" else "loopback:999"
    error = await bounded_error(pair.a.write(bogus, pages(src, dst, [0], [0])))
    assert error.op == "write"
    assert error.code is not None and error.code < 0


@module_loop
async def test_closed_peer_fails_and_closed_engine_refuses(pair: Pair) -> None:
    peer = await peer_engine(pair.kind, pair)
    src, dst = Buffer(PAGE), Buffer(PAGE)
    pair.a.register(src.addr, PAGE)
    pair.registered.append((pair.a, src))
    peer.register(dst.addr, PAGE)
    data = src.fill_random(5)
    await pair.a.write(peer.session_id, [Entry(src.addr, dst.addr, PAGE)])
    assert dst.read() == data
    await peer.close()
    await peer.close()  # idempotent
    error = await bounded_error(pair.a.write(peer.session_id, [Entry(src.addr, dst.addr, PAGE)]))
    assert error.op == "write"
    with pytest.raises(EngineError) as info:
        peer.register(dst.addr, PAGE)
    assert info.value.op == "register"
    with pytest.raises(EngineError):
        await peer.write(pair.a.session_id, [Entry(dst.addr, src.addr, PAGE)])


@module_loop
async def test_registration_errors(pair: Pair) -> None:
    region = Buffer(4 * PAGE)
    pair.a.register(region.addr, region.size)
    pair.registered.append((pair.a, region))
    with pytest.raises(EngineError) as overlap:
        pair.a.register(region.addr + PAGE, PAGE)
    with pytest.raises(EngineError) as empty:
        pair.a.register(Buffer(PAGE).addr, 0)
    with pytest.raises(EngineError) as unknown:
        pair.a.unregister(region.addr + PAGE)
    assert [overlap.value.op, empty.value.op, unknown.value.op] == [
        "register",
        "register",
        "unregister",
    ]
    assert [overlap.value.code, empty.value.code, unknown.value.code] == [-7, -1, -3]


@module_loop
async def test_empty_write_and_bad_entry(pair: Pair) -> None:
    src, dst = pair.buffers(PAGE)
    await pair.a.write(pair.b.session_id, [])
    with pytest.raises(ValueError):
        await pair.a.write(pair.b.session_id, [Entry(src.addr, dst.addr, 0)])


@module_loop
async def test_concurrent_writes_to_one_peer(pair: Pair) -> None:
    n, size, writers = 1500, 1024, 3  # 4500 entries at once would wedge a raw TCP transport
    src, dst = pair.buffers(n * size, writers * n * size)
    data = src.fill_random(6)
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, pair.in_flight())
            await asyncio.sleep(0)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(
        *(
            pair.a.write(
                pair.b.session_id, pages(src, dst, range(n), range(w * n, (w + 1) * n), size)
            )
            for w in range(writers)
        )
    )
    sampler.cancel()
    assert peak <= MAX_ENTRIES_PER_BATCH
    for w in range(writers):
        assert dst.read(w * n * size, n * size) == data


# ------------------------------------------------------------------ Mooncake only


@module_loop
async def test_mooncake_session_id(mooncake_engines: tuple[MooncakeEngine, MooncakeEngine]) -> None:
    a, b = mooncake_engines
    host, port = a.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert a.session_id != b.session_id


@module_loop
async def test_mooncake_cancelled_write_keeps_entries_accounted(
    mooncake_engines: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    a, b = mooncake_engines
    n = 4096
    src, dst = Buffer(n * PAGE), Buffer(n * PAGE)
    a.register(src.addr, src.size)
    b.register(dst.addr, dst.size)
    try:
        write = asyncio.create_task(a.write(b.session_id, pages(src, dst, range(n), range(n))))
        await eventually(lambda: a.in_flight(b.session_id) > 0, pause=0)
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        assert a.in_flight(b.session_id) > 0  # cancelling the wait does not forget the entries
        await eventually(lambda: a.in_flight(b.session_id) == 0)
        data = src.fill_random(7)
        await a.write(b.session_id, pages(src, dst, range(8), range(8)))
        assert dst.read(0, 8 * PAGE) == data[: 8 * PAGE]
    finally:
        a.unregister(src.addr)
        b.unregister(dst.addr)


# ------------------------------------------------------------------ loopback only


@module_loop
async def test_loopback_injected_failures() -> None:
    network = LoopbackNetwork()
    a, b = network.engine(), network.engine()
    src, dst = Buffer(8 * PAGE), Buffer(8 * PAGE)
    a.register(src.addr, src.size)
    b.register(dst.addr, dst.size)
    data = src.fill_random(8)
    entries = pages(src, dst, range(8), range(8))
    a.fail_writes(2, code=-5, after_entries=3)
    for _ in range(2):
        with pytest.raises(EngineError) as info:
            await a.write(b.session_id, entries)
        assert (info.value.op, info.value.code) == ("write", -5)
    assert dst.read(0, 3 * PAGE) == data[: 3 * PAGE]  # copied before the failure
    assert dst.read(3 * PAGE) == bytes(5 * PAGE)
    await a.write(b.session_id, entries)
    assert dst.read() == data
    assert a.stats.writes == 3 and a.stats.entries == 3 + 3 + 8


@module_loop
async def test_loopback_delay_and_peer_closing_meanwhile() -> None:
    network = LoopbackNetwork()
    a, b = network.engine(), network.engine()
    src, dst = Buffer(PAGE), Buffer(PAGE)
    a.register(src.addr, PAGE)
    b.register(dst.addr, PAGE)
    a.delay_s = 0.05
    start = time.monotonic()
    await a.write(b.session_id, [Entry(src.addr, dst.addr, PAGE)])
    assert time.monotonic() - start >= 0.05
    write = asyncio.create_task(a.write(b.session_id, [Entry(src.addr, dst.addr, PAGE)]))
    await asyncio.sleep(0.01)
    await b.close()
    error = await bounded_error(write)
    assert error.op == "write"


@module_loop
async def test_loopback_networks_are_separate() -> None:
    one, two = LoopbackNetwork(), LoopbackNetwork()
    a, b = one.engine(), two.engine()
    src, dst = Buffer(PAGE), Buffer(PAGE)
    a.register(src.addr, PAGE)
    b.register(dst.addr, PAGE)
    assert a.session_id == b.session_id  # same name, different networks
    with pytest.raises(EngineError):
        await a.write(b.session_id, [Entry(src.addr, dst.addr, PAGE)])  # a's own session


# ------------------------------------------------------------------ helpers


def test_region_table() -> None:
    table = RegionTable()
    table.add(1000, 100)
    table.add(2000, 10)
    assert len(table) == 2
    assert table.contains(1000, 100) and table.contains(1050, 50) and table.contains(2005, 5)
    assert not table.contains(999, 2) and not table.contains(1050, 51)
    assert not table.contains(1100, 1) and not table.contains(500, 1)
    assert table.overlaps(1099, 1) and table.overlaps(900, 101) and table.overlaps(1999, 2)
    assert not table.overlaps(1100, 900) and not table.overlaps(900, 100)
    with pytest.raises(ValueError):
        table.add(1050, 1)
    with pytest.raises(ValueError):
        table.add(3000, 0)
    assert table.remove(1000) and not table.remove(1000)
    assert not table.contains(1000, 1)


@module_loop
async def test_peer_budget_is_first_come_first_served_and_cancellable() -> None:
    budget = PeerBudget(1024)
    await budget.acquire(1000)
    big = asyncio.create_task(budget.acquire(100))
    small = asyncio.create_task(budget.acquire(10))
    cancelled = asyncio.create_task(budget.acquire(5))
    await asyncio.sleep(0)
    assert not big.done() and not small.done()  # small waits behind big despite 24 free
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    budget.release(1000)
    await asyncio.wait_for(asyncio.gather(big, small), 1)
    assert budget.in_flight == 110
    budget.release(110)
    assert budget.in_flight == 0
