"""Outlier ejections shared by the processes of ``router --workers N`` over the host's bus (real
ZeroMQ over ipc; two processes' pools, detectors and buses on one event loop), and passed on
between the host's bus and the replicas' sync."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from router.fleet.outlier import OutlierDetector
from router.fleet.shared_ejections import EjectionVerdict, share_ejections
from router.settings import OutlierSettings
from router.sharing import HOST_BUS_KINDS
from router.workers import Role, Worker, WorkerPool
from testkit.polling import await_until
from testkit.verdict_channel import MemoryChannel
from tests.router.kv_cache.test_shared_predictions import two_buses


def pool_of(prefills: int = 2) -> WorkerPool[None]:
    """One process's pool: the same workers (the same ids) in every process."""
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    for index in range(prefills):
        pool.add(Worker(Role.PREFILL, f"http://p{index}:8000", healthy=True), None)
    pool.add(Worker(Role.DECODE, "http://d0:8000", healthy=True), None)
    return pool


def frozen(worker: Worker) -> None:
    """Legs in flight for 10 s and none completed since: overdue."""
    now = time.monotonic()
    worker.legs.started = {0: now - 10.0, 1: now - 10.0}
    worker.legs.last_completed = now - 10.0
    worker.legs.latency_s = 0.01


def detector_of(pool: WorkerPool[None], counted: list[str], percent: int = 50) -> OutlierDetector:
    settings = OutlierSettings(max_ejection_percent=percent)
    return OutlierDetector(pool, settings, on_eject=lambda role, why: counted.append(why))


async def test_a_prefill_ejected_in_one_process_is_ejected_in_the_other(tmp_path: Path) -> None:
    """Process 0 finds a frozen prefill (its own legs); process 1 routes nothing to it from
    then on either (marked down, its waiting legs told), for the same ejection time, without
    counting the ejection a second time."""
    pools = [pool_of(), pool_of()]
    counted: list[list[str]] = [[], []]
    detectors = [detector_of(p, c) for p, c in zip(pools, counted, strict=True)]
    async with two_buses(tmp_path, HOST_BUS_KINDS) as buses:  # as the router opens the bus
        for detector, pool, bus in zip(detectors, pools, buses, strict=True):
            share_ejections(detector, pool.get, host=bus)

        # the SUB socket joins a few ms after it connects: a verdict nobody knows until it crosses
        async def crossed() -> bool:
            buses[0].publish(EjectionVerdict("prefill:http://nowhere:1", 5.0, "warm-up"))
            await asyncio.sleep(0.01)
            return buses[1].received > 0

        deadline = time.monotonic() + 5.0
        while not await crossed():
            assert time.monotonic() < deadline, "no message crossed the bus"
        there = pools[1].prefill[0]
        told = there.loss_signal()
        frozen(pools[0].prefill[0])
        assert detectors[0].check() == [pools[0].prefill[0]]
        await await_until(lambda: not there.healthy, 5.0, "the ejection in the other process")
        assert there.ejected and there.ejected_until > time.monotonic() + 4.0
        assert "ejected by outlier detection" in await asyncio.wait_for(told, 1.0)
        assert pools[1].prefill[1].healthy
        assert counted == [["overdue"], []]  # counted once, by the process that found it
        assert detectors[1].check() == []


def test_a_shared_ejection_keeps_the_receivers_budget_and_holds_a_worker_already_down() -> None:
    pool, counted = pool_of(prefills=2), list[str]()
    detector = detector_of(pool, counted)
    host = MemoryChannel()
    share_ejections(detector, pool.get, host=host)
    first, second = pool.prefill
    frozen(second)
    assert detector.check() == [second]  # 50% of 2: this process's budget is spent
    host.deliver(EjectionVerdict(first.id, 5.0, "overdue elsewhere"))
    assert first.healthy and not first.ejected  # never both prefills of the pool

    pool = pool_of(prefills=2)
    detector = detector_of(pool, counted)
    host = MemoryChannel()
    share_ejections(detector, pool.get, host=host)
    down = pool.prefill[0]
    down.mark_down("probe failed")
    host.deliver(EjectionVerdict(down.id, 30.0, "overdue elsewhere"))
    # down already: the probes may not bring it back before the sender's ejection time is over
    assert down.ejected and down.ejected_until > time.monotonic() + 25.0
    assert pool.prefill[1].healthy


def test_ejections_pass_between_the_hosts_processes_and_the_replicas() -> None:
    """Process 0 of a replica with --workers N: its own ejection goes to its siblings and to the
    peers; a sibling's goes on to the peers; a peer's is followed and sent to nobody."""
    pool, counted = pool_of(prefills=4), list[str]()
    detector = detector_of(pool, counted, percent=75)  # three of four may be out
    host, fleet = MemoryChannel(), MemoryChannel()
    share_ejections(detector, pool.get, host=host, fleet=fleet)
    mine, sibling, peer, _ = pool.prefill
    frozen(mine)
    assert detector.check() == [mine]
    assert [v.worker_id for v in host.published] == [mine.id]
    assert [v.worker_id for v in fleet.published] == [mine.id]
    told = EjectionVerdict(sibling.id, 5.0, "timeouts in a sibling")
    host.deliver(told)
    assert not sibling.healthy and fleet.published[-1] == told
    fleet.deliver(EjectionVerdict(peer.id, 5.0, "overdue in a peer"))
    assert not peer.healthy and peer.ejected
    assert len(host.published) == 1 and len(fleet.published) == 2
    assert counted == ["overdue"]
