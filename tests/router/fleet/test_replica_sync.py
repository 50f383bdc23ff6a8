"""``ReplicaSync`` by itself: what it takes from a peer's snapshots and what it counts (the
messages handed to ``receive`` as the socket would)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator

import msgspec
import pytest
from pydantic import SecretStr

from registry.backends import MemoryStore
from router.fleet.replica_peers import REPLICAS_PREFIX, ReplicaPeers
from router.fleet.replica_sync import LoadSnapshot, ReplicaSync
from router.load_board import DISPATCHED, LEGS, TOKENS
from router.settings import ReplicaSettings
from router.workers import Role, Worker
from testkit.polling import await_until
from testkit.servers import free_port

TOKEN = "replica-test-token-0123"


@pytest.fixture
def sync() -> Iterator[ReplicaSync]:
    peers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    settings = ReplicaSettings(
        listen=f"127.0.0.1:{free_port()}", peers=peers, id="me", token=SecretStr(TOKEN), stale_s=0.2
    )
    worker = Worker(Role.DECODE, "http://127.0.0.1:9")
    made = ReplicaSync(settings, lambda: [worker])
    yield made
    made.close()


def frame(replica: str, seq: int, legs: list[int], *, epoch: float = 1.0, units: int = 0) -> bytes:
    snapshot = LoadSnapshot(replica, epoch, seq, time.time(), units, {"w": (legs, [7] * len(legs))})
    payload = msgspec.msgpack.encode(snapshot)
    return ReplicaSync.mac(TOKEN.encode(), payload) + payload


def test_the_peers_counts_add_up_per_rank(sync: ReplicaSync) -> None:
    sync.receive(frame("p", 1, [1, 2], units=3))
    sync.receive(frame("q", 1, [4], units=1))
    assert [sync.count("w", rank, LEGS) for rank in (0, 1, 2)] == [5, 2, 0]
    assert sync.count("w", 0, TOKENS) == 14
    assert sync.count("w", 0, DISPATCHED) == 0  # (credits stay per replica)
    assert sync.count("other", 0, LEGS) == 0
    assert sync.units() == 4
    assert sync.degraded() is None


def test_the_latest_snapshot_wins_and_misses_are_counted(sync: ReplicaSync) -> None:
    sync.receive(frame("p", 1, [1]))
    sync.receive(frame("p", 4, [3]))  # 2 and 3 lost
    sync.receive(frame("p", 2, [9]))  # late: old news
    assert sync.count("w", 0, LEGS) == 3
    (peer,) = sync.stats()["peers"]
    assert (peer["seq"], peer["gaps"], peer["restarts"]) == (4, 2, 0)


def test_a_restarted_peer_is_taken_at_once(sync: ReplicaSync) -> None:
    sync.receive(frame("p", 50, [3]))
    sync.receive(frame("p", 1, [1], epoch=2.0))  # a new run starts its sequence again
    assert sync.count("w", 0, LEGS) == 1
    (peer,) = sync.stats()["peers"]
    assert (peer["seq"], peer["gaps"], peer["restarts"]) == (1, 0, 1)


def test_a_silent_peer_stops_counting_and_degrades_the_replica(sync: ReplicaSync) -> None:
    sync.receive(frame("p", 1, [2], units=2))
    sync.receive(frame("q", 1, [1]))
    time.sleep(0.25)  # (stale_s = 0.2)
    sync.receive(frame("q", 2, [1]))
    sync.expire()
    assert sync.count("w", 0, LEGS) == 1 and sync.units() == 0
    assert sync.degraded() == "1 of 2 replica peer(s) not heard within 0.2s"


def test_forged_unreadable_and_own_messages_are_not_taken(sync: ReplicaSync) -> None:
    good = frame("p", 1, [2])
    sync.receive(b"x" * 32 + good[32:])  # a wrong HMAC
    payload = b"not msgpack"
    sync.receive(ReplicaSync.mac(TOKEN.encode(), payload) + payload)
    sync.receive(frame("me", 1, [9]))  # our own, from a peer list that names us
    assert sync.rejected == 2 and sync.count("w", 0, LEGS) == 0
    sync.receive(good)
    assert sync.count("w", 0, LEGS) == 2


def test_the_published_snapshot_is_this_replicas_own_state(
    sync: ReplicaSync, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync.own_units = lambda: 3
    sent: list[bytes] = []

    def send(data: bytes, flags: int = 0) -> None:
        sent.append(data)

    monkeypatch.setattr(sync._pub, "send", send)
    sync.publish_state()
    snapshot = msgspec.msgpack.decode(sent[0][32:], type=LoadSnapshot)
    assert (snapshot.replica, snapshot.seq, snapshot.units) == ("me", 1, 3)
    assert snapshot.workers == {"decode:http://127.0.0.1:9": ([0], [0])}


async def test_peers_by_dns_are_every_address_the_name_resolves_to_but_our_own() -> None:
    port = free_port()
    mine = f"127.0.0.1:{port}"
    other = f"127.0.0.1:{free_port()}"
    settings = ReplicaSettings(
        listen=mine,
        peers=[other],
        peers_dns=f"localhost:{port}",  # resolves to this replica's own address
        token=SecretStr(TOKEN),
        dns_interval_s=0.01,
    )
    sync = ReplicaSync(settings, list)
    sync.finder = ReplicaPeers(settings, sync.set_peers)
    task = asyncio.create_task(sync.run())
    try:
        await asyncio.sleep(0.1)
        addresses = sync.stats()["peer_addresses"]
        assert other in addresses and mine not in addresses  # the static one, not ourselves
        assert set(addresses) <= {other, f"[::1]:{port}"}  # (localhost may be ::1 as well)
        sync.set_peers([other, "127.0.0.1:1"])
        assert sync.stats()["peer_addresses"] == ["127.0.0.1:1", other]
        assert sync.degraded() == "2 of 2 replica peer(s) not heard within 1s"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sync.close()


async def test_peers_in_the_registry_register_follow_and_leave() -> None:
    store = MemoryStore()  # (the store a registry serves; replicas share it through etcd)
    settings = [
        ReplicaSettings(
            listen=f"127.0.0.1:{free_port()}",
            id=name,
            token=SecretStr(TOKEN),
            peers_registry=True,
            dns_interval_s=0.01,
        )
        for name in ("a", "b")
    ]
    followed: dict[str, list[set[str]]] = {"a": [], "b": []}

    def follower(name: str) -> Callable[[Iterable[str]], None]:
        return lambda found: followed[name].append(set(found))

    finders = [ReplicaPeers(s, follower(s.id), store, ttl_s=5) for s in settings]
    tasks = [asyncio.create_task(f.run()) for f in finders]
    try:
        addresses = {s.listen for s in settings}
        await asyncio.sleep(0.1)
        assert followed["a"][-1] == addresses == followed["b"][-1]  # (own left out by the sync)
        assert set(await store.list(REPLICAS_PREFIX)) == {"replicas/a", "replicas/b"}
        tasks[1].cancel()  # b stops: its key goes, and a follows b no more
        await asyncio.gather(tasks[1], return_exceptions=True)
        await asyncio.sleep(0.1)
        assert followed["a"][-1] == {settings[0].listen}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _pair_settings() -> tuple[ReplicaSettings, ReplicaSettings]:
    ports = free_port(), free_port()
    a, b = (f"127.0.0.1:{port}" for port in ports)
    made = (
        ReplicaSettings(listen=a, peers=[b], id="a", token=SecretStr(TOKEN), interval_s=0.02),
        ReplicaSettings(listen=b, peers=[a], id="b", token=SecretStr(TOKEN), interval_s=0.02),
    )
    return made


async def test_two_replicas_hear_each_other_even_when_the_socket_wakes_nobody(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SUB socket's descriptor is edge-triggered: a wake-up lost (here: every one) must not
    leave the peer's snapshots unread; each replica still hears the other within intervals."""
    worker = Worker(Role.DECODE, "http://127.0.0.1:9")
    worker.rank_inflight[0] = 2
    syncs = [ReplicaSync(settings, lambda: [worker]) for settings in _pair_settings()]
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "add_reader", lambda *_: None)
    monkeypatch.setattr(loop, "remove_reader", lambda *_: True)
    tasks = [asyncio.create_task(sync.run()) for sync in syncs]
    try:
        heard = lambda: all(sync.count(worker.id, 0, LEGS) == 2 for sync in syncs)  # noqa: E731
        await await_until(heard, 10, "each replica hears the other")
        assert [sync.stats()["degraded"] for sync in syncs] == [None, None]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sync in syncs:
            sync.close()
