"""Predictions shared by the processes of ``router --workers N`` over the host's bus (real
ZeroMQ over ipc; here two processes' indexes and buses on one event loop)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from router.kv_cache.index import KVBlockIndex
from router.kv_cache.shared_predictions import Prediction, SharedPredictions
from router.process_role import ProcessRole
from router.sibling_bus import SiblingBus

BLOCK = 16
_keys = itertools.count(1000)


def role(tmp_path: Path, index: int) -> ProcessRole:
    return ProcessRole(index=index, count=2, supervisor_pid=0, run_dir=str(tmp_path), port=0)


def fresh_keys(n: int = 4) -> list[int]:
    return [next(_keys) for _ in range(n)]


@asynccontextmanager
async def two_buses(tmp_path: Path) -> AsyncIterator[list[SiblingBus]]:
    buses = [SiblingBus(role(tmp_path, i), (Prediction,)) for i in range(2)]
    tasks = [asyncio.create_task(bus.run()) for bus in buses]
    try:
        yield buses
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for bus in buses:
            bus.close()


async def test_a_prediction_made_in_one_process_routes_in_the_other(tmp_path: Path) -> None:
    first, second = KVBlockIndex(10_000, 30.0), KVBlockIndex(10_000, 30.0)
    async with two_buses(tmp_path) as buses:
        SharedPredictions(first, buses[0])
        SharedPredictions(second, buses[1])
        async with asyncio.timeout(10):  # a SUB socket joins a few ms after it connects
            while True:
                keys = fresh_keys()
                first.predict(("p-1", 0), keys, BLOCK)
                await asyncio.sleep(0.01)
                if second.match(keys, BLOCK):
                    break
        keys = fresh_keys()
        first.predict(("p-1", 1), keys, BLOCK)
        async with asyncio.timeout(5):
            while not second.match(keys, BLOCK):  # noqa: ASYNC110 - polled with a deadline
                await asyncio.sleep(0.005)
        assert second.match(keys, BLOCK) == {("p-1", 1): len(keys)}
        # what a process learnt from a sibling is not sent back
        assert buses[1].sent == 0 and buses[1].received >= 2
        assert buses[1].stats()["lag_s"] is not None


async def test_missed_messages_are_counted(tmp_path: Path) -> None:
    bus = SiblingBus(role(tmp_path, 1), (Prediction,))
    seen: list[Prediction] = []
    bus.on(Prediction, seen.append)
    try:
        for seq in (1, 2, 5, 6, 10):
            bus.deliver(0, seq, 0.0, Prediction("p-1", 0, BLOCK, fresh_keys()))
        assert bus.gaps == 2 + 3 and bus.received == 5 and len(seen) == 5
    finally:
        bus.close()
