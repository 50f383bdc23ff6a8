"""Policies choose only among the candidates they are given, by their rule."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from router.scheduling.policies import build_policy, least_loaded_rank
from router.scheduling.policies.power_of_two import PowerOfTwo
from router.workers import EngineLoad, Role, Worker


def _workers(*loads: int) -> list[Worker]:
    workers = [Worker(Role.DECODE, f"http://127.0.0.1:{9000 + i}") for i in range(len(loads))]
    for worker, load in zip(workers, loads, strict=True):
        worker.inflight = load
    return workers


def _report(worker: Worker, running: float, waiting: float = 0.0) -> Worker:
    """The engine's own (fresh) load report for a one-rank worker."""
    worker.record_engine_load(
        [EngineLoad(running, waiting)],
        at=time.monotonic(),
        stale_after=60.0,
        dispatched=list(worker.rank_dispatched),
    )
    return worker


def test_round_robin_cycles_in_order() -> None:
    policy = build_policy("round_robin")
    workers = _workers(0, 0, 0)
    assert [policy.choose(workers).url[-4:] for _ in range(6)] == [
        "9000",
        "9001",
        "9002",
        "9000",
        "9001",
        "9002",
    ]


def test_least_load_picks_fewest_inflight() -> None:
    policy = build_policy("least_load")
    workers = _workers(5, 1, 3)
    assert {policy.choose(workers) for _ in range(5)} == {workers[1]}


def test_least_load_breaks_ties_round_robin() -> None:
    policy = build_policy("least_load")
    workers = _workers(2, 0, 0, 7)
    picks = Counter(policy.choose(workers).url for _ in range(100))
    assert set(picks) == {workers[1].url, workers[2].url}
    assert abs(picks[workers[1].url] - picks[workers[2].url]) <= 2


def test_least_load_follows_the_engines_report_over_inflight_counts() -> None:
    """Other routers' traffic shows only in the engine's report: it decides when known."""
    policy = build_policy("least_load")
    workers = _workers(0, 4, 1)
    _report(workers[0], running=10, waiting=5)
    _report(workers[1], running=2, waiting=1)
    assert {policy.choose(workers) for _ in range(5)} == {workers[2]}  # in-flight 1 < 3
    _report(workers[2], running=6)
    assert {policy.choose(workers) for _ in range(5)} == {workers[1]}


def test_least_load_credits_requests_sent_since_the_report() -> None:
    """Requests that already ended still count until the engine's next report says so."""
    policy = build_policy("least_load")
    idle, busy = _workers(0, 0)
    _report(idle, running=0)
    _report(busy, running=2)
    picks = []
    for _ in range(6):
        chosen = policy.choose([idle, busy])
        with chosen.load():
            picks.append(chosen)
    assert picks[:2] == [idle, idle]
    assert picks.count(idle) == 4 and idle.load_score() == busy.load_score() == 4.0


def test_power_of_two_compares_engine_load_when_known() -> None:
    policy = PowerOfTwo(random.Random(5))
    workers = _workers(0, 9)
    _report(workers[0], running=30)
    _report(workers[1], running=2, waiting=1)
    assert all(policy.choose(workers) is workers[1] for _ in range(20))


def test_power_of_two_prefers_the_less_loaded_of_its_two_samples() -> None:
    policy = PowerOfTwo(random.Random(7))
    workers = _workers(100, 0)
    assert all(policy.choose(workers) is workers[1] for _ in range(20))
    spread = Counter(policy.choose(_workers(0, 0, 0, 0)).url[-1] for _ in range(400))
    assert len(spread) == 4  # every equally loaded worker is chosen sometimes


def test_power_of_two_never_picks_the_most_loaded_of_three() -> None:
    policy = PowerOfTwo(random.Random(3))
    workers = _workers(0, 50, 99)
    assert all(policy.choose(workers) is not workers[2] for _ in range(200))


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="round_robin, least_load, power_of_two"):
        build_policy("random")


def test_least_loaded_rank() -> None:
    worker = Worker(Role.PREFILL, "http://127.0.0.1:1")
    worker.set_layout(4)
    worker.rank_inflight[:] = [3, 1, 1, 2]
    assert [least_loaded_rank(worker) for _ in range(3)] == [1, 2, 1]
    with worker.load(1):
        assert worker.rank_inflight == [3, 2, 1, 2] and worker.inflight == 1
    assert worker.rank_inflight == [3, 1, 1, 2] and worker.inflight == 0
