"""Predictions shared by the processes of ``router --workers N`` over the host's bus (real
ZeroMQ over ipc) and by replicas over their sync (real ZeroMQ over TCP on 127.0.0.1, HMAC
checked); here the processes' indexes, buses and syncs on one event loop."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from pydantic import SecretStr

from router.fleet.replica_sync import ReplicaSync
from router.fleet.shared_breakers import BreakerVerdict
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.shared_predictions import Prediction, SharedPredictions
from router.process_role import ProcessRole
from router.settings import ReplicaSettings
from router.sibling_bus import SiblingBus
from testkit.servers import free_port
from testkit.tasks import running

BLOCK = 16
TOKEN = "replica-test-token-0123"
_keys = itertools.count(1000)


def role(tmp_path: Path, index: int) -> ProcessRole:
    return ProcessRole(index=index, count=2, supervisor_pid=0, run_dir=str(tmp_path), port=0)


def fresh_keys(n: int = 4) -> list[int]:
    return [next(_keys) for _ in range(n)]


@asynccontextmanager
async def two_buses(
    tmp_path: Path, kinds: tuple[type[msgspec.Struct], ...] = (Prediction,)
) -> AsyncIterator[list[SiblingBus]]:
    """The buses of processes 0 and 1 of a host, running."""
    buses = [SiblingBus(role(tmp_path, i), kinds) for i in range(2)]
    try:
        async with running(*(bus.run() for bus in buses)):
            yield buses
    finally:
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


@asynccontextmanager
async def replicas(*processes: tuple[str, bool]) -> AsyncIterator[list[ReplicaSync]]:
    """One sync per (replica name, publishes) (several processes of a replica: one publishes),
    each following the other replicas' addresses."""
    addresses = {name: f"127.0.0.1:{free_port()}" for name, _ in processes}
    syncs = []
    for name, publishes in processes:
        peers = [address for other, address in addresses.items() if other != name]
        settings = ReplicaSettings(
            listen=addresses[name], peers=peers, id=name, token=SecretStr(TOKEN)
        )
        kinds = (BreakerVerdict, Prediction)
        syncs.append(ReplicaSync(settings, list, publishes=publishes, kinds=kinds))
    try:
        async with running(*(sync.run() for sync in syncs)):
            yield syncs
    finally:
        for sync in syncs:
            sync.close()


async def until_shared(source: KVBlockIndex, target: KVBlockIndex, rank: int = 0) -> list[int]:
    """Predict fresh keys in ``source`` until ``target`` has them (a SUB socket joins some ms
    after it connects: earlier ones are lost); the keys that arrived."""
    async with asyncio.timeout(10):
        while True:
            keys = fresh_keys()
            source.predict(("p-1", rank), keys, BLOCK)
            await asyncio.sleep(0.02)
            if target.match(keys, BLOCK):
                return keys


async def test_a_prediction_made_by_one_replica_routes_in_the_other() -> None:
    first, second = KVBlockIndex(10_000, 30.0), KVBlockIndex(10_000, 30.0)
    async with replicas(("a", True), ("b", True)) as (sync_a, sync_b):
        SharedPredictions(first, fleet=sync_a)
        SharedPredictions(second, fleet=sync_b)
        keys = await until_shared(first, second, rank=1)
        assert second.match(keys, BLOCK) == {("p-1", 1): len(keys)}
        assert first.match(fresh_keys(), BLOCK) == {}
        notes_sent = sync_b.sent
        await until_shared(second, first)  # and back
        assert sync_b.sent > notes_sent
        # what a replica learnt from its peer is not sent back to it
        sent = sync_b.sent
        keys = fresh_keys()
        first.predict(("p-1", 0), keys, BLOCK)
        async with asyncio.timeout(5):
            while not second.match(keys, BLOCK):  # noqa: ASYNC110 - polled with a deadline
                await asyncio.sleep(0.005)
        assert sync_b.sent == sent
        assert [peer["replica"] for peer in sync_b.stats()["peers"]] == ["a"]


async def test_a_siblings_prediction_reaches_the_replica_peers_through_process_0(
    tmp_path: Path,
) -> None:
    """Replica a runs two processes: process 1's prediction goes to process 0 over the bus,
    which passes it on to replica b (process 1's own sync sends nothing)."""
    zero, one, peer = (KVBlockIndex(10_000, 30.0) for _ in range(3))
    processes = (("a", True), ("a", False), ("b", True))
    async with two_buses(tmp_path) as buses, replicas(*processes) as (sync_a, sync_a_one, sync_b):
        SharedPredictions(zero, buses[0], sync_a)
        SharedPredictions(one, buses[1], sync_a_one)
        SharedPredictions(peer, fleet=sync_b)
        keys = await until_shared(one, peer)
        assert zero.match(keys, BLOCK) == {("p-1", 0): len(keys)}
        assert sync_a_one.sent == 0 and sync_a.sent >= 1
        # and b's predictions reach both processes of a, each by its own subscription
        await until_shared(peer, one)
        await until_shared(peer, zero)
