"""Health probes and engine load reads once per host (``router --workers N``): the leader's
rounds reach the followers over the real host bus (ZeroMQ over ipc), a follower probes by
itself only at its start and while the leader is silent, and an engine behind ``router
--workers 2`` gets the probes of one router."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from router.fleet.engine_cache import EngineCache, EngineCaches
from router.fleet.health import HealthProber
from router.fleet.host_probes import LEADER_TIMEOUTS, HostProbes, ProbeRound
from router.process_role import ProcessRole
from router.settings import EngineProtocol, HealthSettings
from router.sibling_bus import SiblingBus
from router.workers import EngineLoad, Role, Worker, WorkerPool
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import await_until, wait_until
from testkit.tasks import running
from tests.router.kv_cache.test_shared_predictions import two_buses
from tests.router.server.test_workers import processes_of, supervised

PREFILL = "http://127.0.0.1:9001"
DECODE = "http://127.0.0.1:9002"
INTERVAL_S = 0.05


def pool() -> WorkerPool[None]:
    """A process's pool of one prefill and one decode (the same ids in every process)."""
    made: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    for worker in (Worker(Role.PREFILL, PREFILL), Worker(Role.DECODE, DECODE)):
        made.add(worker, None)
    return made


class Probes:
    """A process's own probe rounds, counted."""

    def __init__(self) -> None:
        self.rounds = 0

    async def __call__(self) -> None:
        self.rounds += 1


@asynccontextmanager
async def host(
    tmp_path: Path,
) -> AsyncIterator[tuple[list[WorkerPool[None]], list[HostProbes], Probes]]:
    """Process 0 (the leader) and process 1 (a follower), each with its pool and the real bus;
    the follower's own probe rounds are counted."""
    async with two_buses(tmp_path, (ProbeRound,)) as buses:
        pools = [pool(), pool()]
        own = Probes()
        probes = [
            HostProbes(pools[i], buses[i], leader=i == 0, interval_s=INTERVAL_S, probe=own)
            for i in range(2)
        ]
        async with running(*(p.run() for p in probes)):
            yield pools, probes, own


async def test_the_leaders_verdicts_layouts_models_and_loads_reach_the_follower(
    tmp_path: Path,
) -> None:
    async with host(tmp_path) as ((lead, follow), _, own):
        prefill, decode = lead.prefill[0], lead.decode[0]
        prefill.set_layout(2, ("engine-a", "engine-b"))
        prefill.mark_up()
        decode.mark_up()
        lead.set_models(decode, frozenset({"m1", "m2"}), declared=False, adapters=frozenset({"m2"}))
        now = time.monotonic()
        prefill.record_engine_load(
            [EngineLoad(3, 1, 0.5), None], at=now, stale_after=60, dispatched=[7, 0]
        )
        theirs_p, theirs_d = follow.prefill[0], follow.decode[0]
        await await_until(lambda: theirs_p.healthy and theirs_d.healthy, 10, "both up")
        assert theirs_p.engine_ids == ("engine-a", "engine-b") and theirs_p.dp_size == 2
        assert theirs_d.models == frozenset({"m1", "m2"}) and not theirs_d.models_declared
        assert theirs_d.adapters == frozenset({"m2"})  # a LoRA adapter there too
        reading = theirs_p.engine_load[0]
        assert reading is not None and theirs_p.engine_load[1] is None
        assert (reading.load, reading.at, reading.dispatched) == (EngineLoad(3, 1, 0.5), now, 7)

        lost = theirs_d.loss_signal()  # a request bound to the decode in the follower
        decode.mark_down("probes failed")
        await asyncio.wait_for(lost, 10)  # told at once when the leader's round comes
        assert not theirs_d.healthy
        prefill.set_layout(2, ("engine-c", "engine-d"))  # the prefill restarted
        await await_until(lambda: theirs_p.engine_ids == ("engine-c", "engine-d"), 10, "restart")
        assert own.rounds == 1  # its own round at its start only: the leader speaks


async def test_a_verdict_of_the_leaders_probes_reaches_the_follower_at_once(
    tmp_path: Path,
) -> None:
    """A worker the leader's probes find up (or down) is up in the follower within the bus's
    lag, not at the leader's next interval: at a first start, the processes join the port
    before the engines are up, and the follower answered 503 while the leader served."""
    async with two_buses(tmp_path, (ProbeRound,)) as buses:
        pools = [pool(), pool()]
        probes = [
            HostProbes(pools[i], buses[i], leader=i == 0, interval_s=30.0, probe=Probes())
            for i in range(2)
        ]
        prober = HealthProber(pools[0], EngineProtocol.SGLANG, HealthSettings())
        prober.on_verdict = probes[0].changed  # as router.sharing.probe_tasks wires the leader
        async with running(*(p.run() for p in probes)):
            async with asyncio.timeout(10):  # a SUB socket joins a few ms after it connects
                while not buses[1].received:
                    probes[0].changed()  # a round of the verdicts as they are (all down)
                    await asyncio.sleep(0.01)
            assert not pools[1].decode[0].healthy
            prober._probe_succeeded(pools[0].decode[0])  # its first good probe: up
            await await_until(lambda: pools[1].decode[0].healthy, 2.0, "up at once")
        await prober.aclose()


async def test_a_worker_this_process_ejected_stays_out_for_its_ejection_time(
    tmp_path: Path,
) -> None:
    async with host(tmp_path) as ((lead, follow), probes, _):
        lead.decode[0].mark_up()
        theirs = follow.decode[0]
        theirs.ejected, theirs.ejected_until = True, time.monotonic() + 60
        rounds = probes[1].rounds
        await await_until(lambda: probes[1].rounds >= rounds + 3, 10, "rounds taken")
        assert not theirs.healthy
        theirs.ejected_until = time.monotonic()  # its ejection time is over
        await await_until(lambda: theirs.healthy, 10, "back once the ejection ended")


async def test_the_leaders_first_round_of_verdicts_is_told_when_it_ends() -> None:
    """Its first probes mark workers up before the round is over, when the leader may not yet
    publish (a restarted leader tells nothing before its first round): the round's end tells."""
    prober = HealthProber(pool(), EngineProtocol.SGLANG, HealthSettings())
    told: list[int] = []
    prober.on_verdict = lambda: told.append(prober.rounds)
    await prober.probe_all()  # nothing listens there: the probes fail, a round all the same
    await prober.probe_all()
    assert told == [1]
    await prober.aclose()


async def test_the_leaders_ejection_travels_as_an_ejection_not_as_a_probe_verdict(
    tmp_path: Path,
) -> None:
    """A worker the leader ejected (outlier detection) is not told down in its rounds while
    the ejection lasts: the ejection reaches the follower over the bus, where the follower's
    own ejection budget decides (router.fleet.shared_ejections); once it is over, the rounds
    tell what the probes see."""
    async with host(tmp_path) as ((lead, follow), probes, _):
        ours, theirs = lead.decode[0], follow.decode[0]
        ours.mark_up()
        await await_until(lambda: theirs.healthy, 10, "up in the follower")
        ours.ejected, ours.ejected_until = True, time.monotonic() + 60
        ours.mark_down("ejected by outlier detection")
        rounds = probes[1].rounds
        await await_until(lambda: probes[1].rounds >= rounds + 3, 10, "rounds taken")
        assert theirs.healthy
        ours.ejected_until = time.monotonic()  # over, and its probes have not brought it back
        await await_until(lambda: not theirs.healthy, 10, "down once the ejection ended")


async def test_a_follower_probes_by_itself_while_the_leader_is_silent(tmp_path: Path) -> None:
    role = ProcessRole(index=1, count=2, supervisor_pid=0, run_dir=str(tmp_path), port=0)
    bus = SiblingBus(role, (ProbeRound,))
    own = Probes()
    follower = HostProbes(pool(), bus, leader=False, interval_s=INTERVAL_S, probe=own)
    task = asyncio.create_task(follower.run())
    try:
        await await_until(lambda: own.rounds >= 3, 10, "its own rounds")
        assert follower.fallbacks == own.rounds - 1
        follower.take(ProbeRound([]))  # the leader is back
        rounds = own.rounds
        await asyncio.sleep((LEADER_TIMEOUTS - 1) * INTERVAL_S)  # less than its patience
        assert own.rounds == rounds
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        bus.close()


# --------------------------------------------------------------------------- router --workers 2


@contextmanager
def router_of(processes: int) -> Iterator[tuple[FakeEngine, FakeEngine]]:
    """``router --workers processes`` probing every 0.1 s (no load reads), once its followers
    took the leader's rounds; its fake prefill and decode."""
    engines = (
        FakeEngine("prefill", "sglang", config=FakeConfig(check_kv=False)),
        FakeEngine("decode", "sglang", config=FakeConfig(check_kv=False)),
    )
    faster = ("--health-interval", "0.1", "--load-interval", "0")  # after supervised's 0.2
    with supervised(*faster, processes=processes, engines=engines) as (url, _):
        wait_until(lambda: _rounds_taken(url) >= 2 or processes == 1, 20, "rounds followed")
        yield engines


def _rounds_taken(url: str) -> int:
    """The fewest leader rounds a follower of the router took (0: none yet)."""
    stats: list[Any] = [process.get("probes") for process in processes_of(url)]
    taken = [int(s["rounds"]) for s in stats if isinstance(s, dict) and not s["leader"]]
    return min(taken, default=0)


def test_an_engine_gets_the_probes_of_one_router_from_router_workers_2() -> None:
    """Probes every 0.1 s: 15 of them take one router 1.5 s; two processes probing each would
    send them in half that."""
    with router_of(2) as (prefill, decode):
        start, began = decode.health_checks, time.monotonic()
        wait_until(lambda: decode.health_checks >= start + 15, 20, "15 more health probes")
        elapsed = time.monotonic() - began
    assert elapsed >= 0.75 * 15 * 0.1, elapsed
    assert prefill.health_checks > 0


async def test_a_restarted_leader_tells_nothing_before_its_first_round_of_probes(
    tmp_path: Path,
) -> None:
    """Its workers are not known yet, not down: the followers keep their own verdicts."""
    lead, follow = pool(), pool()
    follow.decode[0].mark_up()  # the follower found it up
    probed = False
    async with two_buses(tmp_path, (ProbeRound,)) as buses:
        leader = HostProbes(
            lead, buses[0], leader=True, interval_s=INTERVAL_S, probe=Probes(),
            probed=lambda: probed,
        )  # fmt: skip
        follower = HostProbes(follow, buses[1], leader=False, interval_s=INTERVAL_S, probe=Probes())
        async with running(leader.run()):
            async with asyncio.timeout(10):
                while buses[1].received == 0:  # noqa: ASYNC110 - the bus joined: a round would come
                    buses[0].publish(ProbeRound([]))
                    await asyncio.sleep(INTERVAL_S)
            rounds = follower.rounds
            await asyncio.sleep(4 * INTERVAL_S)  # rounds it would have sent
            assert (leader.rounds, follower.rounds) == (0, rounds)
            assert follow.decode[0].healthy
            probed = True  # its first round done: the decode it found down goes down
            await await_until(lambda: not follow.decode[0].healthy, 10, "the leader's verdict")


def metrics_text(hits: int, queries: int) -> str:
    return (
        f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
        f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n'
        'vllm:cache_config_info{block_size="32",engine="0"} 1.0\n'
    )


async def test_the_leaders_prefix_cache_counters_reach_the_follower(tmp_path: Path) -> None:
    """Only the leader reads the engines' /metrics: the follower's routing states and doctor
    get the prefills' block size and hit rate from its rounds, each reading once."""
    lead, follow = pool(), pool()
    caches = [EngineCaches(), EngineCaches()]
    prefill = lead.prefill[0]
    async with two_buses(tmp_path, (ProbeRound,)) as buses:
        probes = [
            HostProbes(
                (lead, follow)[i],
                buses[i],
                leader=i == 0,
                interval_s=INTERVAL_S,
                probe=Probes(),
                caches=caches[i],
            )  # fmt: skip
            for i in range(2)
        ]
        async with running(*(p.run() for p in probes)):
            caches[0].record(prefill.id, 1, metrics_text(10, 40), time.monotonic())
            theirs = lambda: caches[1].get((prefill.id, 0))  # noqa: E731
            await await_until(lambda: theirs() is not None, 10, "the first reading")
            caches[0].record(prefill.id, 1, metrics_text(40, 100), time.monotonic())
            await await_until(lambda: (theirs() or EngineCache()).hit_rate() is not None, 10, "")
            rounds = probes[1].rounds
            await await_until(lambda: probes[1].rounds >= rounds + 3, 10, "more rounds")
    cache = theirs()
    assert cache is not None and cache.block_size == 32
    assert len(cache.readings) == 2  # the same reading in later rounds is taken once
    assert cache.hit_rate() == (0.5, 60.0)  # (40 - 10) / (100 - 40)
