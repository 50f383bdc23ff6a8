"""Predictions shared by the processes of ``router --workers N`` (real ZeroMQ over ipc; here
two processes' indexes and sharers on one event loop)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from router.kv_cache.index import KVBlockIndex
from router.kv_cache.shared_predictions import SharedPredictions, _Prediction
from router.process_role import ProcessRole

BLOCK = 16
_keys = itertools.count(1000)


def role(tmp_path: Path, index: int) -> ProcessRole:
    return ProcessRole(index=index, count=2, supervisor_pid=0, run_dir=str(tmp_path), port=0)


def fresh_keys(n: int = 4) -> list[int]:
    return [next(_keys) for _ in range(n)]


async def test_a_prediction_made_in_one_process_routes_in_the_other(tmp_path: Path) -> None:
    first, second = KVBlockIndex(10_000, 30.0), KVBlockIndex(10_000, 30.0)
    sharers = [
        SharedPredictions(first, role(tmp_path, 0)),
        SharedPredictions(second, role(tmp_path, 1)),
    ]
    tasks = [asyncio.create_task(s.run()) for s in sharers]
    try:
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
        assert sharers[1].sent == 0 and sharers[1].received >= 2
        assert sharers[1].stats()["lag_s"] is not None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sharer in sharers:
            sharer.close()


async def test_missed_predictions_are_counted(tmp_path: Path) -> None:
    index = KVBlockIndex(10_000, 30.0)
    sharer = SharedPredictions(index, role(tmp_path, 1))
    try:
        for seq in (1, 2, 5, 6, 10):
            sharer._apply(_Prediction(0, seq, 0.0, "p-1", 0, BLOCK, fresh_keys()))
        assert sharer.gaps == 2 + 3 and sharer.received == 5
    finally:
        sharer.close()
