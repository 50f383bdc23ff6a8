"""Outlier detection (router.fleet.outlier) on an injected clock: who is ejected, when, and
how many at most."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from router.fleet.health import HealthProber
from router.fleet.outlier import OutlierDetector
from router.settings import EngineProtocol, HealthSettings, OutlierSettings
from router.workers import EngineLoad, Role, Worker, WorkerPool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pool(prefills: int = 2, decodes: int = 2) -> WorkerPool[None]:
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    for index in range(prefills):
        pool.add(Worker(Role.PREFILL, f"http://p{index}:8000", healthy=True), None)
    for index in range(decodes):
        pool.add(Worker(Role.DECODE, f"http://d{index}:8000", healthy=True), None)
    return pool


def _legs(worker: Worker, *, started: list[float], completed: float, latency: float) -> None:
    worker.legs.started = dict(enumerate(started))
    worker.legs.last_completed = completed
    worker.legs.latency_s = latency


def _detector(
    pool: WorkerPool[None], clock: Clock, **settings: Any
) -> tuple[OutlierDetector, list[tuple[str, str]]]:
    ejections: list[tuple[str, str]] = []
    detector = OutlierDetector(
        pool,
        OutlierSettings(**settings),
        clock=clock,
        on_eject=lambda role, why: ejections.append((role, why)),
    )
    return detector, ejections


def test_a_prefill_whose_legs_stopped_completing_is_ejected_and_its_legs_end() -> None:
    clock, pool = Clock(), _pool()
    frozen, healthy = pool.prefill
    detector, ejections = _detector(pool, clock, overdue_floor_s=1.5)
    _legs(
        frozen, started=[clock.now - 1.0, clock.now - 0.5], completed=clock.now - 1.0, latency=0.01
    )
    _legs(healthy, started=[clock.now - 0.01], completed=clock.now, latency=0.01)
    assert detector.check() == []  # within the floor
    clock.now += 0.6
    loss = None

    async def watch() -> None:
        nonlocal loss
        signal = frozen.loss_signal()
        assert detector.check() == [frozen]
        loss = await signal

    asyncio.run(watch())
    assert loss is not None and "ejected by outlier detection" in loss
    assert not frozen.healthy and frozen.ejected and frozen.ejected_until == clock.now + 5.0
    assert healthy.healthy and ejections == [("prefill", "overdue")]
    assert detector.check() == []  # once


def test_a_busy_prefill_that_still_completes_legs_is_not_ejected() -> None:
    """An old leg alone (a long prompt) is no evidence while other legs complete."""
    clock, pool = Clock(), _pool()
    busy = pool.prefill[0]
    detector, _ = _detector(pool, clock, overdue_floor_s=1.5)
    _legs(busy, started=[clock.now - 30.0, clock.now - 0.1], completed=clock.now - 0.2, latency=1)
    assert detector.check() == []


def test_one_long_prompt_alone_on_an_idle_prefill_is_not_ejected() -> None:
    """A single leg in flight (a 100k-token prompt takes seconds) is no evidence: a frozen
    prefill under load has legs piling up."""
    clock, pool = Clock(), _pool()
    alone = pool.prefill[0]
    detector, _ = _detector(pool, clock, overdue_floor_s=1.5)
    _legs(alone, started=[clock.now - 30.0], completed=clock.now - 60.0, latency=0.05)
    assert detector.check() == []
    alone.legs.started[1] = clock.now - 2.0  # a second leg piles up behind it: now it is
    assert detector.check() == [alone]


def test_a_prefill_that_still_answers_its_load_reads_is_queueing_not_frozen() -> None:
    """Legs piled up behind a full KV pool look overdue; an engine that answered a load read
    within the allowance is alive. Once its reads stop too (frozen), it is ejected."""
    clock, pool = Clock(), _pool()
    queueing = pool.prefill[0]
    detector, _ = _detector(pool, clock, overdue_floor_s=1.5)
    _legs(queueing, started=[clock.now - 5.0] * 3, completed=clock.now - 5.0, latency=0.05)
    load = EngineLoad(running=4, waiting=20, kv_usage=1.0)
    queueing.record_engine_load([load], at=clock.now - 0.5, stale_after=3.0, dispatched=[0])
    assert detector.check() == []
    clock.now += 1.5  # no read answered since: frozen
    assert detector.check() == [queueing]


def test_the_allowance_follows_the_workers_own_latency() -> None:
    clock, pool = Clock(), _pool()
    slow = pool.prefill[0]
    detector, _ = _detector(pool, clock, overdue_floor_s=1.5, overdue_factor=10.0)
    _legs(
        slow, started=[clock.now - 15.0, clock.now - 9.0], completed=clock.now - 15.0, latency=2.0
    )
    assert detector.allowance_s(slow) == pytest.approx(20.0)
    assert detector.check() == []  # 15 s is within 10 x its 2 s legs
    clock.now += 6.0
    assert detector.check() == [slow]


def test_consecutive_timeouts_eject_any_role() -> None:
    clock, pool = Clock(), _pool()
    decode = pool.decode[1]
    detector, ejections = _detector(pool, clock, consecutive_timeouts=3)
    decode.legs.timeouts_in_row = 2
    assert detector.check() == []
    decode.legs.timeouts_in_row = 3
    assert detector.check() == [decode]
    assert ejections == [("decode", "timeouts")] and decode.legs.timeouts_in_row == 0


def test_decodes_are_not_judged_by_the_age_of_their_legs() -> None:
    """A decode's leg lasts as long as its generation."""
    clock, pool = Clock(), _pool()
    detector, _ = _detector(pool, clock)
    _legs(pool.decode[0], started=[clock.now - 300.0], completed=-1e18, latency=0.0)
    assert detector.check() == []


def test_ejection_is_bounded_by_its_share_and_never_takes_the_last_worker() -> None:
    clock, pool = Clock(), _pool(prefills=4)
    detector, _ = _detector(pool, clock, max_ejection_percent=50)
    for worker in pool.prefill:  # all four stopped completing legs
        _legs(worker, started=[clock.now - 10.0] * 2, completed=clock.now - 10.0, latency=0.01)
    assert len(detector.check()) == 2  # 50% of 4
    assert len(detector.check()) == 0
    assert sum(w.healthy for w in pool.prefill) == 2

    clock, pool = Clock(), _pool(prefills=2)
    detector, _ = _detector(pool, clock, max_ejection_percent=100)
    pool.prefill[0].healthy = False  # down already (probes)
    _legs(pool.prefill[1], started=[clock.now - 10.0] * 2, completed=clock.now - 10.0, latency=0.01)
    assert detector.check() == []  # the last prefill in service stays


def test_an_ejected_worker_comes_back_through_the_probes_after_its_ejection_time() -> None:
    pool = _pool()
    worker = pool.prefill[0]
    prober = HealthProber(pool, EngineProtocol.SGLANG, HealthSettings(healthy_threshold=2))
    worker.seen_healthy = True
    worker.mark_down("ejected")
    worker.ejected, worker.ejected_until = True, time.monotonic() + 60.0
    for _ in range(3):  # good probes within the ejection time do not bring it back
        prober._probe_succeeded(worker)
    assert not worker.healthy
    worker.ejected_until = time.monotonic() - 1.0
    prober._probe_succeeded(worker)
    assert worker.healthy and not worker.ejected
    asyncio.run(prober.aclose())


def test_leg_stats_time_completed_legs_only() -> None:
    worker = Worker(Role.PREFILL, "http://p:8000")
    with worker.load():
        assert worker.legs.oldest_start() is not None
    assert worker.legs.latency_s > 0 and worker.legs.started == {}
    completed = worker.legs.last_completed
    with pytest.raises(RuntimeError), worker.load():
        raise RuntimeError("the leg failed")
    assert worker.legs.last_completed == completed and worker.inflight == 0
