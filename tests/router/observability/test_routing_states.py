"""The routing states per prefill rank and pool (``router.observability.routing_states``),
judged from stand-in evidence: the policy, the token source, the KV event feed's counters and the
agreement window. End to end (a simulated cluster): ``test_routing_agreement.py``."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from router.kv_cache.event_feed import FeedStats
from router.kv_cache.index import KVBlockIndex
from router.observability.agreement import AgreementBoard
from router.observability.routing_states import RoutingInputs, RoutingStates
from router.settings import ObservabilitySettings
from router.workers import Role, Worker

URL = "http://127.0.0.1:9"


class Feed:
    def __init__(self) -> None:
        self.stats: dict[tuple[str, int], FeedStats] = {}

    def evidence(self, location: tuple[str, int]) -> FeedStats | None:
        return self.stats.get(location)


def _prefill(models: frozenset[str] = frozenset()) -> Worker:
    return Worker(Role.PREFILL, URL, healthy=True, models=models)


def _states(
    worker: Worker,
    feed: Feed,
    board: AgreementBoard,
    transitions: list[tuple[str, str]],
    *,
    predicts: bool = True,
    tokenizes: bool = True,
) -> RoutingStates:
    inputs = RoutingInputs(
        lambda: [worker], feed, KVBlockIndex(1000, 2.0), board, predicts, tokenizes
    )
    settings = ObservabilitySettings(agreement_min_requests=4, events_stale_s=30.0)
    return RoutingStates(inputs, settings, lambda scope, to: transitions.append((scope, to)))


def _transitions() -> list[tuple[str, str]]:
    return []


def _rank(states: RoutingStates) -> dict[str, Any]:
    ranks: list[dict[str, Any]] = states.describe()["ranks"]
    [rank] = ranks
    return rank


def _flowing(feed: Feed, worker: Worker, at: float = 0.0) -> FeedStats:
    stats = feed.stats[(worker.id, 0)] = FeedStats("tcp://127.0.0.1:5557", None, batches=1)
    stats.last_batch_at = at
    return stats


def _agreeing(board: AgreementBoard, worker: Worker, requests: int, predicted: int) -> None:
    rank = board.rank(worker.id, 0, worker.public_url)
    for _ in range(requests):
        rank.record(predicted, 160, 200, 200, False, True)


@pytest.mark.parametrize(
    ("predicts", "tokenizes", "stream", "why"),
    [
        (False, True, True, "the prefill policy routes on load only"),
        (True, False, True, "no token ids"),
        (True, True, False, "no KV event stream"),
    ],
)
def test_routing_without_events_is_a_fallback(
    predicts: bool, tokenizes: bool, stream: bool, why: str
) -> None:
    worker, feed, transitions = _prefill(), Feed(), _transitions()
    if stream:
        _flowing(feed, worker)
    states = _states(
        worker, feed, AgreementBoard(), transitions, predicts=predicts, tokenizes=tokenizes
    )
    states.evaluate(now=100.0)
    states.evaluate(now=101.0)
    rank = _rank(states)
    assert rank["state"] == "fallback" and why in rank["reason"]
    assert transitions == [("rank", "fallback"), ("pool", "fallback")]  # once each
    assert states.describe()["pools"] == [
        {"pool": "default", "state": "fallback", "reason": f"prefill {URL} rank 0: "
         + rank["reason"]}
    ]  # fmt: skip


def test_a_stream_with_no_event_yet_is_a_fallback() -> None:
    worker, feed, transitions = _prefill(), Feed(), _transitions()
    feed.stats[(worker.id, 0)] = FeedStats("tcp://127.0.0.1:5557", None)
    states = _states(worker, feed, AgreementBoard(), transitions)
    states.evaluate(now=100.0)
    assert "no KV event received yet" in _rank(states)["reason"]


def test_events_flowing_and_predictions_agreeing_is_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, feed, board, transitions = _prefill(), Feed(), AgreementBoard(), _transitions()
    _flowing(feed, worker, at=99.0)
    states = _states(worker, feed, board, transitions)
    states.evaluate(now=100.0)
    assert _rank(states)["reason"] == "KV events flowing; too few requests to compare"
    _agreeing(board, worker, 4, predicted=160)
    with caplog.at_level(logging.INFO, "router.observability.routing_states"):
        states.evaluate(now=101.0)
    rank = _rank(states)
    assert rank["state"] == "exact"
    assert (
        rank["reason"]
        == "KV events flowing; predictions agree: error 0.0% of the prompt over 4 requests"
    )
    assert transitions == [] and caplog.records == []  # starting well is no news


def test_predictions_off_degrade_the_rank_until_they_agree_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, feed, board, transitions = _prefill(), Feed(), AgreementBoard(window=4), _transitions()
    _flowing(feed, worker, at=99.0)
    states = _states(worker, feed, board, transitions)
    _agreeing(board, worker, 4, predicted=160)
    states.evaluate(now=100.0)
    _agreeing(board, worker, 4, predicted=0)  # the engine found 160 where none was predicted
    with caplog.at_level(logging.INFO, "router.observability.routing_states"):
        states.evaluate(now=101.0)
        states.evaluate(now=102.0)
        rank = _rank(states)
        assert rank["state"] == "degraded"
        assert rank["reason"] == (
            "predictions off: mean error 80.0% of the prompt over 4 requests (tolerance 10%)"
        )
        _agreeing(board, worker, 4, predicted=150)
        states.evaluate(now=103.0)
    assert _rank(states)["state"] == "exact"
    assert transitions == [
        ("rank", "degraded"), ("pool", "degraded"), ("rank", "exact"), ("pool", "exact")
    ]  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"routing state of prefill {URL} rank 0: exact -> degraded: {rank['reason']}",
        f"routing state of pool default: exact -> degraded: prefill {URL} rank 0: "
        + rank["reason"],
    ]


def test_lost_event_batches_degrade_the_rank_for_a_while() -> None:
    worker, feed, transitions = _prefill(), Feed(), _transitions()
    stats = _flowing(feed, worker, at=99.0)
    states = _states(worker, feed, AgreementBoard(), transitions)
    states.evaluate(now=100.0)
    stats.lost = 3  # lost before the stream was followed (no purge): not a gap of the index
    states.evaluate(now=105.0)
    assert _rank(states)["state"] == "exact"
    stats.lost, stats.purges = 5, 1
    states.evaluate(now=110.0)
    rank = _rank(states)
    assert rank["state"] == "degraded"
    assert rank["reason"] == (
        "KV events gapped 0s ago (lost 5, publisher restarts 0, index purges 1 so far)"
    )
    states.evaluate(now=139.0)
    assert _rank(states)["state"] == "degraded"
    states.evaluate(now=141.0)  # events_stale_s after the gap
    assert _rank(states)["state"] == "exact"


def test_a_silent_stream_degrades_the_rank() -> None:
    worker, feed, board, transitions = _prefill(), Feed(), AgreementBoard(), _transitions()
    _flowing(feed, worker, at=10.0)
    states = _states(worker, feed, board, transitions)
    rank = board.rank(worker.id, 0, URL)
    rank.last_computed_at = 12.0  # its blocks' batch came just before the answer
    states.evaluate(now=100.0)
    assert _rank(states)["state"] == "exact"  # idle since: no news is good news
    rank.last_computed_at = 45.0  # computed 35 s after the last batch
    states.evaluate(now=46.0)
    assert _rank(states)["state"] == "exact"  # its batch may still come
    states.evaluate(now=48.0)
    judged = _rank(states)
    assert judged["state"] == "degraded"
    assert judged["reason"] == (
        "KV events silent: the engine computed prompt tokens 3s ago, the last event batch "
        "came 38s ago"
    )


def test_a_pool_takes_its_worst_rank() -> None:
    worker, feed, board = _prefill(frozenset({"m1", "m2"})), Feed(), AgreementBoard()
    transitions = _transitions()
    worker.set_layout(2)
    _flowing(feed, worker, at=99.0)  # rank 0 follows events, rank 1 does not
    states = _states(worker, feed, board, transitions)
    states.evaluate(now=100.0)
    assert [r["state"] for r in states.describe()["ranks"]] == ["exact", "fallback"]
    assert [(p["pool"], p["state"]) for p in states.describe()["pools"]] == [
        ("m1", "fallback"), ("m2", "fallback")
    ]  # fmt: skip
    worker.healthy = False  # an unhealthy prefill is not judged
    states.evaluate(now=101.0)
    assert states.describe() == {"ranks": [], "pools": []}
