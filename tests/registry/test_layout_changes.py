"""``LayoutChanges`` over each store (memory, a real etcd, a registry over HTTP): a mark holds
until the namespace's rank keys change, SGLang's per-request room notes are neither a change
nor watched, and nothing holds while a watch is not running."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from registry.backends import MemoryStore, RegistryStore, WatchEvent
from registry.engine_api import LayoutChanges, LayoutMark, SglangRankTable, VllmRankTable
from registry.engine_api.vllm_payloads import RegisterWorkerPayload
from registry.errors import RegistryUnavailable
from testkit.polling import await_until
from tests.registry.test_http_registry import CountingStore


def _rank(rank: int) -> dict[str, object]:
    """One rank of a TP-2, DP-2 SGLang prefill (one rank per DP group), as it PUTs ``/route``."""
    return {
        "role": "Prefill",
        "tp_size": 2,
        "dp_size": 2,
        "rank_ip": "127.0.0.1",
        "rank_port": 41000 + rank,
        "engine_rank": rank,
    }


async def _marked(changes: LayoutChanges, namespace: str) -> LayoutMark:
    """The namespace's mark once its watches run (the first ask starts them)."""
    changes.mark(namespace)
    await await_until(lambda: changes.live(namespace), 5.0, f"the watches of {namespace}")
    mark = changes.mark(namespace)
    assert mark is not None
    return mark


async def _seen_so_far(store: RegistryStore, changes: LayoutChanges, namespace: str) -> None:
    """Until the namespace's watches counted every change made so far: one more, to its
    layout key, is counted after them (a watch delivers in store order)."""
    before = changes.mark(namespace)
    assert before is not None
    raw = await store.get(f"bootstrap/sglang/{namespace}/layout")
    assert raw is not None
    await store.put(f"bootstrap/sglang/{namespace}/layout", raw)  # the same value again
    await await_until(lambda: not changes.unchanged(namespace, before), 5.0, "the sync change")


@pytest.fixture
async def changes(store: RegistryStore) -> AsyncIterator[LayoutChanges]:
    watched = LayoutChanges.of_sglang(store)
    yield watched
    await watched.aclose()
    assert not watched.live("p1")
    assert watched.mark("p1") is None  # closed: every read happens


async def test_a_mark_holds_until_its_namespace_changes(
    store: RegistryStore, changes: LayoutChanges
) -> None:
    p1, p2 = SglangRankTable(store, "p1"), SglangRankTable(store, "p2")
    await p1.register(_rank(0))
    await p2.register(_rank(0))
    first, other = await _marked(changes, "p1"), await _marked(changes, "p2")
    await store.get("settle")  # an http store's watches are established before a call

    await p1.register(_rank(1))  # the second rank: p1's layout is complete now
    await _seen_so_far(store, changes, "p1")
    assert not changes.unchanged("p1", first)
    assert changes.unchanged("p2", other)
    assert changes.mark("p1") != first


async def test_the_requests_rooms_never_reach_the_watches() -> None:
    """SGLang's DP rank notes (one per request where the engines use them) are not the
    layout: no watch is told of them, so they cost the watcher nothing."""
    store = CountingStore()
    changes = LayoutChanges.of_sglang(store)
    table = SglangRankTable(store, "p1")
    try:
        await table.register(_rank(0))
        mark = await _marked(changes, "p1")
        for room in range(20):
            await table.register_dp_rank(room=room, dp_rank=room % 2)
        assert await table.query_dp_ranks(range(20)) == {str(r): r % 2 for r in range(20)}
        await _seen_so_far(store, changes, "p1")
        assert store.delivered == 1  # the sync change alone
        assert not changes.unchanged("p1", mark)  # (the sync change)
    finally:
        await changes.aclose()
        await store.close()


async def test_the_vllm_tables_changes_count_and_the_sglang_ones_do_not(
    store: RegistryStore,
) -> None:
    vllm, sglang = LayoutChanges.of_vllm(store), LayoutChanges.of_sglang(store)
    try:
        vllm_mark, sglang_mark = await _marked(vllm, "p1"), await _marked(sglang, "p1")
        await store.get("settle")  # an http store's watches are established before a call
        payload = RegisterWorkerPayload(
            engine_id="e0", dp_rank=0, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:40000"
        )
        await VllmRankTable(store, "p1").register(payload)
        await await_until(lambda: not vllm.unchanged("p1", vllm_mark), 5.0, "the vLLM change")
        assert sglang.unchanged("p1", sglang_mark)
    finally:
        await vllm.aclose()
        await sglang.aclose()


class _RanksWatchFailsOnce(MemoryStore):
    """A memory store whose first watch of a ``ranks/`` prefix breaks after its first event,
    as a lost connection does."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[str] = []

    def watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        self.watched.append(prefix)
        events = super().watch(prefix)
        first = prefix.endswith("ranks/") and self.watched.count(prefix) == 1
        return self._breaking(events) if first else events

    async def _breaking(
        self, events: AsyncGenerator[WatchEvent, None]
    ) -> AsyncGenerator[WatchEvent, None]:
        try:
            yield await anext(events)
            raise RegistryUnavailable("the watch's connection dropped")
        finally:
            await events.aclose()


async def test_marks_from_before_a_broken_watch_never_hold_again() -> None:
    """Changes made while a watch was down are unseen: a mark from before must not hold, and
    none is handed out until the watch runs again."""
    store = _RanksWatchFailsOnce()
    changes = LayoutChanges.of_sglang(store, retry_s=0.2)
    try:
        table = SglangRankTable(store, "p1")
        await table.register(_rank(0))  # the layout record and a rank, before any watch
        before = await _marked(changes, "p1")
        assert sorted(store.watched) == ["bootstrap/sglang/p1/layout", "bootstrap/sglang/p1/ranks/"]
        await table.register(_rank(1))  # a rank alone: the event that breaks its watch
        await await_until(lambda: not changes.live("p1"), 5.0, "the watch to break")
        assert changes.mark("p1") is None
        assert not changes.unchanged("p1", before)
        await await_until(lambda: changes.live("p1"), 5.0, "the watch to run again")
        assert store.watched.count("bootstrap/sglang/p1/ranks/") == 2
        assert not changes.unchanged("p1", before)  # p1 may have changed meanwhile
        after = changes.mark("p1")
        assert after is not None and changes.unchanged("p1", after)
    finally:
        await changes.aclose()
        await store.close()


async def test_namespaces_beyond_the_bound_are_not_watched() -> None:
    store = MemoryStore()
    changes = LayoutChanges.of_sglang(store)
    bounded = LayoutChanges(store, "bootstrap/sglang/", ("layout",), max_namespaces=2)
    try:
        for namespace in ("p1", "p2"):
            await _marked(bounded, namespace)
        assert bounded.mark("p3") is None
        assert changes.mark("p3") is None  # the first ask of an unbounded one starts watching
        await await_until(lambda: changes.live("p3"), 5.0, "the unbounded watches of p3")
        assert not bounded.live("p3")  # beyond the bound: read every time, never watched
        assert bounded.mark("p3") is None
    finally:
        await bounded.aclose()
        await changes.aclose()
        await store.close()
