"""The KV event feed keeps the router's block index equal to what each prefill rank holds.

Real ``transfer.events.KVEventPublisher`` s on 127.0.0.1 stand in for the engines' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import pytest
import zmq

from registry.models import WorkerRecord, decode_worker, encode_worker, worker_id
from router.kv_cache.event_feed import KVEventFeed, rank_endpoint
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.keys import chain_keys
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.kv_tiers import Tier, TierMatch
from router.settings import CacheAwareSettings
from router.workers import Role, Worker
from testkit.fake_cluster import FakeClusterFactory
from testkit.polling import await_until
from testkit.servers import free_port
from transfer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventPublisher,
)

BLOCK = 4
TIMEOUT = 5.0


def stored(hashes: Sequence[int], tokens: Sequence[int], parent: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, list(tokens), BLOCK, None)


def prefill(url: str = "http://127.0.0.1:1", **fields: Any) -> Worker:
    worker = Worker(Role.PREFILL, url, id=fields.pop("id", "p1"), **fields)
    worker.healthy = True
    return worker


class _Lossy(KVEventPublisher):
    """Drops the live copy of the seqs in ``drop`` (they stay in the replay buffer)."""

    def __init__(self, *args: Any, drop: set[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop = drop

    async def _send_live(self, pub: Any, message: Any) -> None:
        if message.seq not in self.drop:
            await super()._send_live(pub, message)


@contextlib.asynccontextmanager
async def feeding(
    workers: list[Worker], settings: CacheAwareSettings | None = None
) -> AsyncIterator[tuple[KVEventFeed, KVBlockIndex, ApproxPrefixTree]]:
    index, tree = KVBlockIndex(10_000), ApproxPrefixTree(1 << 20)
    feed = KVEventFeed(
        lambda: list(workers), index, tree, settings or CacheAwareSettings(), poll_s=0.02
    )
    async with contextlib.AsyncExitStack() as stack:
        task = asyncio.create_task(feed.run())
        stack.push_async_callback(feed.aclose)
        stack.callback(task.cancel)
        yield feed, index, tree


async def publish_until(
    pub: KVEventPublisher, events: list[KVEvent], done: Callable[[], bool], what: str
) -> None:
    """Publish ``events`` (one batch) until ``done``: the first batches may precede the
    subscriber's connection (ZMQ's slow joiner), so resend a bounded number of times."""
    for _ in range(int(TIMEOUT / 0.1)):
        await pub.publish(events)
        with contextlib.suppress(AssertionError):
            await await_until(done, 0.1, what)
            return
    raise AssertionError(f"timed out waiting for {what}")


TOKENS = list(range(100, 112))  # three blocks of four
HASHES = [11, 12, 13]


async def test_stored_removed_and_cleared_events_reach_the_index() -> None:
    async with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        worker = prefill(kv_events=pub.endpoint, kv_events_replay=pub.replay_endpoint)
        async with feeding([worker]) as (feed, index, _):
            loc = (worker.id, 0)
            await publish_until(
                pub, [stored(HASHES, TOKENS)], lambda: index.block_count(loc) == 3, "3 blocks"
            )
            assert index.match(chain_keys(TOKENS, BLOCK), BLOCK) == {loc: 3}
            await pub.publish([BlockRemoved([13])])
            await await_until(lambda: index.block_count(loc) == 2, TIMEOUT, "block 13 removed")
            assert index.match(chain_keys(TOKENS, BLOCK), BLOCK) == {loc: 2}
            await pub.publish([AllBlocksCleared()])
            await await_until(lambda: index.block_count(loc) == 0, TIMEOUT, "all cleared")
            stats = feed.stats(loc)
            assert stats is not None and stats["endpoint"] == pub.endpoint
            assert stats["batches"] + stats["replayed"] >= 3 and stats["purges"] == 0


async def test_host_and_disk_events_reach_their_tiers() -> None:
    """A tiered cache (SGLang HiCache, vLLM's offloading connector): write-through copies to
    host and disk, an eviction from one tier, a medium without a tier, and a full clear."""
    async with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        worker = prefill(kv_events=pub.endpoint, kv_events_replay=pub.replay_endpoint)
        async with feeding([worker]) as (_, index, _):
            loc, keys = (worker.id, 0), chain_keys(TOKENS, BLOCK)
            await publish_until(
                pub,
                [
                    stored(HASHES[:2], TOKENS[:8]),
                    BlockStored(HASHES[:2], None, TOKENS[:8], BLOCK, None, medium="CPU_PINNED"),
                    BlockStored(HASHES[2:], 12, TOKENS[8:], BLOCK, None, medium="CPU"),  # vLLM
                    BlockStored(HASHES, None, TOKENS, BLOCK, None, medium="DISK"),
                    BlockStored([99], 13, list(range(4)), BLOCK, None, medium="EXTERNAL"),
                ],
                lambda: index.block_count(loc, Tier.DISK) == 3,
                "3 blocks on disk",
            )
            assert [index.block_count(loc, tier) for tier in Tier] == [2, 3, 3]
            assert index.match_tiers(keys, BLOCK) == {loc: TierMatch((2, 1, 0))}
            await pub.publish([BlockRemoved(HASHES, medium="CPU_PINNED")])
            await await_until(lambda: index.block_count(loc, Tier.HOST) == 0, TIMEOUT, "host")
            assert index.match_tiers(keys, BLOCK) == {loc: TierMatch((2, 0, 1))}
            await pub.publish([AllBlocksCleared()])
            await await_until(lambda: not index.match_tiers(keys, BLOCK), TIMEOUT, "cleared")
            assert [index.block_count(loc, tier) for tier in Tier] == [0, 0, 0]


async def test_a_router_joining_an_idle_engine_learns_what_it_already_holds() -> None:
    """The engine stored blocks before the router came and then went quiet: no live batch will
    reveal the gap, so the feed must ask the replay endpoint at once."""
    async with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        await pub.publish([stored(HASHES, TOKENS)])
        worker = prefill(kv_events=pub.endpoint, kv_events_replay=pub.replay_endpoint)
        async with feeding([worker]) as (feed, index, _):
            loc = (worker.id, 0)
            await await_until(lambda: index.block_count(loc) == 3, TIMEOUT, "3 blocks replayed")
            stats = feed.stats(loc)
            assert stats is not None and stats["replayed"] == 1 and stats["purges"] == 0


async def test_a_gap_in_the_live_stream_is_replayed() -> None:
    async with _Lossy("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", drop=set()) as pub:
        worker = prefill(kv_events=pub.endpoint, kv_events_replay=pub.replay_endpoint)
        async with feeding([worker]) as (feed, index, _):
            loc = (worker.id, 0)
            await publish_until(
                pub, [stored(HASHES[:1], TOKENS[:4])], lambda: index.block_count(loc) == 1, "b1"
            )
            pub.drop.add(pub.next_seq)  # the next batch never arrives live
            await pub.publish([stored(HASHES[1:2], TOKENS[4:8], parent=11)])
            await pub.publish([stored(HASHES[2:], TOKENS[8:], parent=12)])
            await await_until(lambda: index.block_count(loc) == 3, TIMEOUT, "gap replayed")
            stats = feed.stats(loc)
            assert stats is not None and stats["replayed"] >= 1 and stats["lost"] == 0
            assert index.match(chain_keys(TOKENS, BLOCK), BLOCK) == {loc: 3}


async def test_an_unrecoverable_gap_purges_the_location() -> None:
    async with _Lossy("tcp://127.0.0.1:0", drop=set()) as pub:  # no replay endpoint
        worker = prefill(kv_events=pub.endpoint)
        async with feeding([worker]) as (feed, index, _):
            loc = (worker.id, 0)
            await publish_until(
                pub, [stored(HASHES[:2], TOKENS[:8])], lambda: index.block_count(loc) == 2, "b2"
            )
            pub.drop.add(pub.next_seq)
            await pub.publish([BlockRemoved([11, 12])])  # lost: the index would keep them
            await pub.publish([stored([21], [1, 2, 3, 4])])
            await await_until(lambda: (feed.stats(loc) or {}).get("purges") == 1, TIMEOUT, "purge")
            assert index.block_count(loc) == 1  # only what came after the gap
            assert index.match(chain_keys(TOKENS, BLOCK), BLOCK) == {}


@contextlib.asynccontextmanager
async def _rebound(endpoints: tuple[str, str]) -> AsyncIterator[KVEventPublisher]:
    """A publisher on ports the feed already follows. The feed keeps reconnecting to them, and a
    loopback connect to a port nobody listens on can take it as its own source port for a
    moment (these test ports are in the ephemeral range): retry the bind, bounded."""
    for _ in range(100):
        try:
            pub = await KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1]).__aenter__()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            await asyncio.sleep(0.05)
            continue
        try:
            yield pub
        finally:
            await pub.aclose()
        return
    raise AssertionError(f"could not rebind {endpoints}")


async def test_a_restarted_publisher_purges_what_it_held() -> None:
    port, replay = free_port(), free_port()
    endpoints = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    worker = prefill(kv_events=endpoints[0], kv_events_replay=endpoints[1])
    async with feeding([worker]) as (feed, index, _):
        loc = (worker.id, 0)
        async with _rebound(endpoints) as pub:
            await publish_until(
                pub, [stored(HASHES, TOKENS)], lambda: index.block_count(loc) == 3, "3 blocks"
            )
            for _ in range(3):  # the old stream is well past seq 0
                await pub.publish([])
        async with _rebound(endpoints) as pub:
            await publish_until(
                pub,
                [stored([31], [7, 7, 7, 7])],
                lambda: (feed.stats(loc) or {}).get("restarts", 0) >= 1,
                "restart seen",
            )
            await await_until(lambda: index.block_count(loc) == 1, TIMEOUT, "only the new block")
            assert index.match(chain_keys(TOKENS, BLOCK), BLOCK) == {}


async def test_leaving_draining_dying_or_restarting_workers_are_purged() -> None:
    async with contextlib.AsyncExitStack() as stack:
        pubs = [
            await stack.enter_async_context(
                KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
            )
            for _ in range(4)
        ]
        workers = [
            prefill(
                f"http://127.0.0.1:{i + 1}",
                id=f"p{i}",
                kv_events=pub.endpoint,
                kv_events_replay=pub.replay_endpoint,
            )
            for i, pub in enumerate(pubs)
        ]
        pool = list(workers)
        async with feeding(pool) as (feed, index, tree):
            for worker, pub in zip(workers, pubs, strict=True):
                tree.insert("some text", (worker.id, 0))
                await publish_until(
                    pub,
                    [stored(HASHES, TOKENS)],
                    lambda w=worker: index.block_count((w.id, 0)) == 3,  # type: ignore[misc]
                    f"{worker.id} indexed",
                )
            cleared: list[str] = []  # the workers purged (the restarted one's follow is
            clear_worker = index.clear_worker  # restarted at once and may replay its old
            # stream into the index before a poll could see it empty)

            def spy(worker_id: str) -> None:
                cleared.append(worker_id)
                clear_worker(worker_id)

            index.clear_worker = spy  # type: ignore[method-assign]
            pool.remove(workers[0])
            workers[1].draining = True
            workers[2].healthy = False
            workers[3].epoch += 1  # re-registered: a restart
            await await_until(lambda: "p3" in cleared, TIMEOUT, "p3 purged")
            for worker in workers[:3]:
                await await_until(
                    lambda w=worker: index.block_count((w.id, 0)) == 0,  # type: ignore[misc]
                    TIMEOUT,
                    f"{worker.id} purged",
                )
            for worker in workers:
                assert tree.size((worker.id, 0)) == 0
            for worker in workers[:3]:
                assert feed.stats((worker.id, 0)) is None  # no longer followed
            # the restarted one is followed again: its new stream refills the index
            await publish_until(
                pubs[3],
                [stored([41], [9, 9, 9, 9])],
                lambda: index.block_count((workers[3].id, 0)) >= 1,
                "p3 refilled",
            )


def _consecutive_ports(count: int) -> int:
    """A base port with ``count`` free ports after it (for per-DP-rank endpoints)."""
    for _ in range(50):
        base = free_port()
        if base + count < 65535:
            with contextlib.ExitStack() as stack:
                try:
                    for offset in range(count):
                        sock = stack.enter_context(socket.socket())
                        sock.bind(("127.0.0.1", base + offset))
                except OSError:
                    continue
            return base
    raise RuntimeError("no consecutive free ports")


async def test_each_dp_rank_is_followed_at_port_plus_rank_from_the_settings_ports() -> None:
    live, replay = _consecutive_ports(2), _consecutive_ports(2)
    settings = CacheAwareSettings(kv_events_port=live, kv_events_replay_port=replay)
    worker = prefill()
    worker.set_layout(2)
    async with contextlib.AsyncExitStack() as stack:
        pubs = [
            await stack.enter_async_context(
                KVEventPublisher(
                    f"tcp://127.0.0.1:{live + r}", replay_endpoint=f"tcp://127.0.0.1:{replay + r}"
                )
            )
            for r in range(2)
        ]
        async with feeding([worker], settings) as (feed, index, _):
            await publish_until(
                pubs[1],
                [stored(HASHES[:1], TOKENS[:4])],
                lambda: index.block_count((worker.id, 1)) == 1,
                "rank 1",
            )
            assert index.block_count((worker.id, 0)) == 0
            stats = feed.stats((worker.id, 1))
            assert stats is not None
            assert stats["endpoint"] == f"tcp://127.0.0.1:{live + 1}"
            assert stats["replay_endpoint"] == f"tcp://127.0.0.1:{replay + 1}"


def test_rank_endpoints() -> None:
    assert rank_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    with pytest.raises(ValueError):
        rank_endpoint("tcp://host", 0)


def test_older_registry_records_decode_without_kv_event_endpoints() -> None:
    old = b'{"id":"p-1","role":"prefill","url":"http://h:1","epoch":2}'
    assert decode_worker(old).kv_events is None
    record = WorkerRecord(id="p-1", role="prefill", url="http://h:1", kv_events="tcp://h:5557")
    assert decode_worker(encode_worker(record)).kv_events == "tcp://h:5557"


async def _live_rank(client: httpx.AsyncClient, wid: str) -> dict[str, Any] | None:
    workers = (await client.get("/admin/workers")).json()["workers"]
    for info in workers:
        if info["id"] == wid and info["live"] is not None and info["live"].get("ranks"):
            rank: dict[str, Any] = info["live"]["ranks"][0]
            return rank
    return None


async def test_admin_api_advertises_endpoints_and_draining_purges_the_live_view(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl", prefill=1)
    async with (
        KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub,
        httpx.AsyncClient(base_url=cluster.router_url, timeout=5) as client,
    ):
        url = "http://127.0.0.1:9"  # never healthy: only the advertisement is checked here
        added = await client.post(
            "/admin/workers", json={"role": "prefill", "url": url, "kv_events": pub.endpoint}
        )
        assert added.status_code == 201 and added.json()["kv_events"] == pub.endpoint
        bad = {"role": "prefill", "url": url, "kv_events": "http://x:1"}
        assert (await client.post("/admin/workers", json=bad)).status_code == 400
        # the static prefill, followed through the endpoint an admin re-registers it with
        wid = worker_id("prefill", cluster.prefill_urls[0])
        body = {
            "role": "prefill",
            "url": cluster.prefill_urls[0],
            "kv_events": pub.endpoint,
            "kv_events_replay": pub.replay_endpoint,
        }
        assert (await client.post("/admin/workers", json=body)).status_code == 201

        async def blocks() -> int:
            rank = await _live_rank(client, wid)
            return 0 if rank is None else int(rank["kv_blocks"])

        for _ in range(int(TIMEOUT / 0.1)):  # resent until the feed has subscribed
            await pub.publish([stored(HASHES, TOKENS)])
            if await blocks() == 3:
                break
            await asyncio.sleep(0.1)  # a poll interval, not synchronisation: checked above
        rank = await _live_rank(client, wid)
        assert rank is not None and rank["kv_blocks"] == 3
        assert rank["kv_events"]["endpoint"] == pub.endpoint
        # the index's blocks per rank and tier (medium); a GPU-only rank has only GPU series
        series = 'pdr_kv_index_blocks{{dp_rank="0",medium="{1}",worker="{0}"}} {2}'.format
        metrics = (await client.get("/metrics")).text
        assert series(cluster.prefill_urls[0], "GPU", "3.0") in metrics
        assert 'medium="DISK"' not in metrics
        await pub.publish([BlockStored(HASHES[:2], None, TOKENS[:8], BLOCK, None, medium="DISK")])
        disk = series(cluster.prefill_urls[0], "DISK", "2.0")
        for _ in range(int(TIMEOUT / 0.05)):
            metrics = (await client.get("/metrics")).text
            if disk in metrics:
                break
            await asyncio.sleep(0.05)
        assert disk in metrics and series(cluster.prefill_urls[0], "GPU", "3.0") in metrics
        assert (await client.post(f"/admin/workers/{wid}/drain")).status_code == 202
        for _ in range(int(TIMEOUT / 0.05)):
            if await blocks() == 0:
                break
            await asyncio.sleep(0.05)
        assert await blocks() == 0, "the drained prefill's blocks were not purged"
