"""Breaker verdicts shared by the processes of ``router --workers N`` over the host's bus (real
ZeroMQ over ipc; two processes' breakers and buses on one event loop), and passed on between
the host's bus and the replicas' sync."""

from __future__ import annotations

import asyncio
from pathlib import Path

from router.fleet.circuit_breaker import BreakerPolicy, Circuits, CircuitState
from router.fleet.shared_breakers import BreakerVerdict, share_breakers
from router.process_role import ProcessRole
from router.sibling_bus import SiblingBus
from router.workers import Role, Worker
from testkit.polling import await_until
from testkit.verdict_channel import MemoryChannel

POLICY = BreakerPolicy(failure_threshold=3, open_s=0.3, max_open_s=5.0)


def worker(role: Role, port: int) -> Worker:
    return Worker(role, f"http://127.0.0.1:{port}", id=f"{role.value}-{port}", healthy=True)


PREFILL, DECODE = worker(Role.PREFILL, 9001), worker(Role.DECODE, 9002)
POOL = {w.id: w for w in (PREFILL, DECODE)}
POOL.update({w.id: w for w in (worker(Role.DECODE, port) for port in range(9100, 9300))})
WARM = [w for w in POOL.values() if w.public_url.endswith(tuple(str(p) for p in range(9100, 9300)))]


async def joined(sender: Circuits, receiver: Circuits, spares: list[Worker]) -> None:
    """Until a verdict crosses (a SUB socket joins a few ms after it connects): open one spare
    worker's breaker after another in ``sender`` until ``receiver`` has one open; then close
    them all again."""
    for spare in spares:
        for _ in range(POLICY.failure_threshold):
            sender.worker_failure(spare, "warm-up")
        try:
            await await_until(lambda: bool(receiver.tripped()), 0.05, "a verdict")
        except AssertionError:
            continue
        for circuits in (sender, receiver):
            for each in spares:
                circuits.worker_back(each)
        return
    raise AssertionError("no verdict crossed")


def state(circuits: Circuits, target: Worker) -> CircuitState | None:
    states = dict(circuits.worker_states())
    return states.get((target.role.value, target.public_url))


async def test_a_breaker_opened_in_one_process_opens_in_the_others(tmp_path: Path) -> None:
    roles = [ProcessRole(i, 2, 0, str(tmp_path), 0) for i in range(2)]
    buses = [SiblingBus(r, (BreakerVerdict,)) for r in roles]
    circuits = [Circuits(POLICY, POLICY) for _ in roles]
    for c, bus in zip(circuits, buses, strict=True):
        share_breakers(c, POOL.get, host=bus)
    tasks = [asyncio.create_task(bus.run()) for bus in buses]
    try:
        await joined(circuits[0], circuits[1], WARM[:100])
        await joined(circuits[1], circuits[0], WARM[100:])
        sent, received = buses[1].sent, buses[0].received
        for _ in range(POLICY.failure_threshold):
            circuits[0].worker_failure(DECODE, "connect refused")
        assert state(circuits[0], DECODE) is CircuitState.OPEN
        await await_until(lambda: state(circuits[1], DECODE) is CircuitState.OPEN, 5, "open")
        assert not circuits[1].worker_allows(DECODE)
        reasons = [t.describe()["reason"] for t in circuits[1].tripped()]
        assert any("connect refused) (in another router process)" in r for r in reasons)
        # pairs too
        for _ in range(POLICY.failure_threshold):
            circuits[1].pair_failure(PREFILL, DECODE, "kv lost")
        await await_until(lambda: not circuits[0].pair_allows(PREFILL, DECODE), 5, "pair open")
        # the back-off ends; a trial in process 0 succeeds: process 1 closes too
        await await_until(lambda: circuits[0].worker_allows(DECODE), 5, "half-open")
        circuits[0].worker_success(DECODE)
        await await_until(lambda: state(circuits[1], DECODE) is CircuitState.CLOSED, 5, "close")
        # adopted verdicts are not sent back: process 1 only told of its pair
        assert buses[1].sent - sent == 1 and buses[0].received - received == 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for bus in buses:
            bus.close()


def test_verdicts_pass_between_the_hosts_processes_and_the_replicas() -> None:
    """Process 0 of a replica with --workers N: its own verdict goes to its siblings and to the
    peers; a sibling's goes on to the peers (only process 0 publishes for the host); a peer's
    is followed and not sent to the siblings (each process hears the peers itself)."""
    host, fleet, circuits = MemoryChannel(), MemoryChannel(), Circuits(POLICY, POLICY)
    share_breakers(circuits, POOL.get, host=host, fleet=fleet)
    for _ in range(POLICY.failure_threshold):
        circuits.worker_failure(DECODE, "connect refused")
    assert [v.ids for v in host.published] == [[DECODE.id]] == [v.ids for v in fleet.published]
    sibling = BreakerVerdict([PREFILL.id], True, 1.0, "refused (in a sibling)")
    host.deliver(sibling)
    assert fleet.published[-1] == sibling and state(circuits, PREFILL) is CircuitState.OPEN
    peer = BreakerVerdict([PREFILL.id, DECODE.id], True, 1.0, "kv lost (in a peer)")
    fleet.deliver(peer)
    assert not circuits.pair_allows(PREFILL, DECODE)
    assert len(host.published) == 1 and len(fleet.published) == 2
