"""``LayoutChanges`` over each store (memory, a real etcd, a registry over HTTP): a mark holds
until the namespace's rank keys change, SGLang's per-request room notes are not a change, and
nothing holds while the watch is not running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from registry.backends import MemoryStore, RegistryStore, WatchEvent
from registry.engine_api import LayoutChanges, SglangRankTable, VllmRankTable
from registry.engine_api.vllm_payloads import RegisterWorkerPayload
from registry.errors import RegistryUnavailable
from router.interrupt import reap
from testkit.polling import await_until


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


async def _seen_so_far(store: RegistryStore, changes: LayoutChanges) -> None:
    """Until the watch counted every change made so far: one more, in a namespace of its own,
    is counted after them (a watch delivers in store order)."""
    before = changes.mark("sync")
    await store.put("bootstrap/sglang/sync/layout", b"{}")
    assert before is not None
    await await_until(lambda: not changes.unchanged("sync", before), 5.0, "the sync change")


@pytest.fixture
async def running(store: RegistryStore) -> AsyncIterator[LayoutChanges]:
    changes = LayoutChanges.of_sglang(store)
    task = asyncio.create_task(changes.run())
    await await_until(lambda: changes.live, 5.0, "the watch to run")
    yield changes
    await reap(task)
    assert not changes.live
    assert changes.mark("p1") is None


async def test_a_mark_holds_until_its_namespace_changes(
    store: RegistryStore, running: LayoutChanges
) -> None:
    p1, p2 = SglangRankTable(store, "p1"), SglangRankTable(store, "p2")
    await p1.register(_rank(0))
    await _seen_so_far(store, running)
    first, other = running.mark("p1"), running.mark("p2")
    assert first is not None and other is not None
    assert running.unchanged("p1", first)

    await p1.register(_rank(1))  # the second rank: p1's layout is complete now
    await _seen_so_far(store, running)
    assert not running.unchanged("p1", first)
    assert running.unchanged("p2", other)

    second = running.mark("p1")
    assert second is not None
    await p1.register_dp_rank(room=7, dp_rank=1)  # a request's room: not the layout
    await p2.register(_rank(0))
    await _seen_so_far(store, running)
    assert not running.unchanged("p2", other)
    assert running.unchanged("p1", second)


async def test_the_vllm_tables_changes_count_and_the_sglang_ones_do_not(
    store: RegistryStore,
) -> None:
    vllm, sglang = LayoutChanges.of_vllm(store), LayoutChanges.of_sglang(store)
    tasks = [asyncio.create_task(changes.run()) for changes in (vllm, sglang)]
    try:
        await await_until(lambda: vllm.live and sglang.live, 5.0, "both watches to run")
        vllm_mark, sglang_mark = vllm.mark("p1"), sglang.mark("p1")
        assert vllm_mark is not None and sglang_mark is not None
        await store.get("settle")  # an http store's watches are established before a call
        payload = RegisterWorkerPayload(
            engine_id="e0", dp_rank=0, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:40000"
        )
        await VllmRankTable(store, "p1").register(payload)
        await await_until(lambda: not vllm.unchanged("p1", vllm_mark), 5.0, "the vLLM change")
        assert sglang.unchanged("p1", sglang_mark)
    finally:
        for task in tasks:
            await reap(task)


class _WatchFailsOnce(MemoryStore):
    """A memory store whose first watch breaks after its first event, as a lost connection
    does."""

    def __init__(self) -> None:
        super().__init__()
        self.watches = 0

    def watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        self.watches += 1
        events = super().watch(prefix)
        return self._breaking(events) if self.watches == 1 else events

    async def _breaking(
        self, events: AsyncGenerator[WatchEvent, None]
    ) -> AsyncGenerator[WatchEvent, None]:
        try:
            yield await anext(events)
            raise RegistryUnavailable("the watch's connection dropped")
        finally:
            await events.aclose()


async def test_marks_from_before_a_broken_watch_never_hold_again() -> None:
    """Changes made while the watch was down are unseen: a mark from before must not hold, and
    none is handed out until the watch runs again."""
    store = _WatchFailsOnce()
    changes = LayoutChanges.of_sglang(store, retry_s=0.2)
    task = asyncio.create_task(changes.run())
    try:
        await await_until(lambda: changes.live, 5.0, "the watch to run")
        before = changes.mark("p1")
        assert before is not None
        await SglangRankTable(store, "p2").register(_rank(0))  # the event that breaks it
        await await_until(lambda: not changes.live, 5.0, "the watch to break")
        assert changes.mark("p1") is None
        assert not changes.unchanged("p1", before)
        await await_until(lambda: changes.live, 5.0, "the watch to run again")
        assert store.watches == 2
        assert not changes.unchanged("p1", before)  # p1 may have changed meanwhile
        after = changes.mark("p1")
        assert after is not None and changes.unchanged("p1", after)
    finally:
        await reap(task)
        await store.close()
