"""Session affinity in the route chooser: a pin holds while its workers are sound, yields (and
the session re-pins) when they are not, refuses when hard, and is weighed by cache_aware."""

from __future__ import annotations

from typing import Any, cast

import pytest

from router.errors import NoWorkerAvailable
from router.fleet.circuit_breaker import Circuits, build_circuits
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.observability.metrics import RouterMetrics
from router.scheduling.chooser import Route, RouteChooser
from router.scheduling.features import Featurizer, RequestFeatures
from router.scheduling.policies import CacheAware, Policy, build_policy
from router.scheduling.session_affinity import Held, SessionAffinity
from router.scheduling.session_pins import SessionAsk
from router.settings import (
    CacheAwareSettings,
    CircuitBreakerSettings,
    HealthSettings,
    SessionSettings,
)
from router.upstream.base import UpstreamClient, UpstreamPool
from router.workers import Role, Worker

SESSION = SessionAsk("conversation-1")
TOKENS = list(range(100, 116))  # four blocks of four


class Fleet:
    """A chooser over two prefills and two decodes (healthy, idle), with its pins."""

    def __init__(self, prefill_policy: Policy | None = None, **session: Any) -> None:
        self.pool = UpstreamPool(needs_engine_ids=False)
        self.prefills = [self._add(Role.PREFILL, i) for i in range(2)]
        self.decodes = [self._add(Role.DECODE, i) for i in range(2)]
        self.metrics = RouterMetrics()
        self.circuits: Circuits = build_circuits(
            HealthSettings(failure_threshold=1), CircuitBreakerSettings()
        )
        self.sessions = SessionAffinity(
            SessionSettings(**session), self.pool, self.metrics, self.circuits
        )
        self.chooser = RouteChooser(
            self.pool,
            False,
            prefill_policy or build_policy("round_robin"),
            build_policy("round_robin"),
            self.metrics,
            CacheAwareSettings(),
            Featurizer(None),
            self.circuits,
            self.sessions,
        )

    def _add(self, role: Role, index: int) -> Worker:
        worker = Worker(role, f"http://127.0.0.1:{9000 + index}", id=f"{role.value[0]}{index}")
        worker.healthy = True
        self.pool.add(worker, cast(UpstreamClient, None))
        return worker

    def route(
        self,
        session: SessionAsk | None = SESSION,
        failed: set[str] | None = None,
        features: RequestFeatures | None = None,
    ) -> Route:
        return self.chooser.route(failed or set(), features, count=True, session=session)

    def counted(self, outcome: str, reason: str = "") -> float:
        text = self.metrics.render().decode()
        line = f'pdr_session_pins_total{{outcome="{outcome}",reason="{reason}"}} '
        found = [row for row in text.splitlines() if row.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0


def where(route: Route) -> tuple[str | None, str]:
    return (route.prefill.id if route.prefill is not None else None, route.decode.id)


def test_a_soft_pin_holds_where_round_robin_would_rotate() -> None:
    fleet = Fleet()
    first = where(fleet.route())
    others = {where(fleet.route(session=None)) for _ in range(4)}
    assert len(others) == 2  # without a session the requests rotate
    for _ in range(5):
        assert where(fleet.route()) == first
        fleet.route(session=None)  # other traffic moves the cursors in between
    assert (fleet.counted("new"), fleet.counted("hit")) == (1, 5)
    assert len(fleet.sessions.pins) == 1


@pytest.mark.parametrize("fault", ["unhealthy", "draining", "broken", "overloaded"])
def test_a_soft_pin_yields_when_its_prefill_is_unsound_and_the_session_re_pins(
    fault: str,
) -> None:
    fleet = Fleet()
    pinned_prefill, pinned_decode = where(fleet.route())
    prefill = fleet.pool.get(pinned_prefill or "")
    assert prefill is not None
    if fault == "unhealthy":
        prefill.healthy = False
    elif fault == "draining":
        prefill.draining = True
    elif fault == "broken":
        fleet.circuits.worker_failure(prefill, "connect")
    else:
        prefill.rank_inflight[0] = 3  # 3 > 2 * (0 + 1): over the default bound
    moved = where(fleet.route())
    assert moved[0] != pinned_prefill
    assert moved[1] == pinned_decode  # the decode's part of the pin still holds
    assert fleet.counted("repinned", fault) == 1
    # the session now follows its new pin, even once the old prefill is sound again
    prefill.healthy, prefill.draining, prefill.rank_inflight[0] = True, False, 0
    fleet.circuits.worker_success(prefill)
    assert where(fleet.route()) == moved
    assert fleet.counted("hit") == 1


def test_the_load_bound_leaves_a_small_difference_alone_and_zero_turns_it_off() -> None:
    fleet = Fleet()
    pinned = where(fleet.route())
    prefill = fleet.pool.get(pinned[0] or "")
    assert prefill is not None
    prefill.rank_inflight[0] = 2  # 2 <= 2 * (0 + 1)
    assert where(fleet.route()) == pinned
    unbounded = Fleet(load_bound=0)
    pinned = where(unbounded.route())
    busy = unbounded.pool.get(pinned[0] or "")
    assert busy is not None
    busy.rank_inflight[0] = 100
    assert where(unbounded.route()) == pinned


def test_a_retry_re_pins_the_failed_part_only() -> None:
    fleet = Fleet()
    prefill, decode = where(fleet.route())
    retried = where(fleet.route(failed={decode}))
    assert retried[0] == prefill and retried[1] != decode
    assert fleet.counted("repinned", "failed") == 1
    assert where(fleet.route()) == retried


def test_a_hard_pin_refuses_rather_than_moving_the_session() -> None:
    fleet = Fleet(mode="hard")
    prefill, decode = where(fleet.route())
    worker = fleet.pool.get(decode)
    assert worker is not None
    worker.draining = True
    with pytest.raises(NoWorkerAvailable) as refused:
        fleet.route()
    assert refused.value.status == 503 and "pinned (hard)" in refused.value.message
    assert fleet.counted("refused", "draining") == 1
    explained = fleet.chooser.explain(None, SESSION)
    assert explained["choice"] is None and "pinned (hard)" in explained["error"]
    assert fleet.counted("refused", "draining") == 1  # explaining counts nothing
    worker.draining = False
    worker.rank_inflight[0] = 50  # load never moves a hard pin
    assert where(fleet.route()) == (prefill, decode)


def test_a_request_may_ask_for_a_hard_pin_and_a_removed_worker_is_re_pinned() -> None:
    fleet = Fleet()
    hard = SessionAsk(SESSION.key, hard=True)
    prefill, decode = where(fleet.route(hard))
    worker = fleet.pool.get(prefill or "")
    assert worker is not None
    worker.healthy = False
    with pytest.raises(NoWorkerAvailable):
        fleet.route(hard)
    assert where(fleet.route())[0] != prefill  # the same session, soft: it moves
    fleet.route(hard)
    gone = fleet.sessions.pins.get(SESSION.key)
    assert gone is not None and gone.prefill is not None
    fleet.pool.remove(gone.prefill)
    worker.healthy = True
    assert where(fleet.route(hard))[0] == prefill  # nothing left to wait for: re-pinned
    assert fleet.counted("repinned", "gone") == 1


def test_a_skipped_prefill_leg_keeps_the_prefill_pinned() -> None:
    fleet = Fleet()
    prefill, decode = where(fleet.route())
    pin = fleet.sessions.pins.get(SESSION.key)
    other = next(w for w in fleet.decodes if w.id != decode)
    fleet.sessions.record(SESSION, Held(pin), (None, 0, other), None)
    repinned = fleet.sessions.pins.get(SESSION.key)
    assert repinned is not None and (repinned.prefill, repinned.decode) == (prefill, other.id)


def test_the_table_is_bounded() -> None:
    fleet = Fleet(max_entries=2)
    for i in range(10):
        fleet.route(SessionAsk(f"s{i}"))
    assert len(fleet.sessions.pins) == 2
    assert fleet.sessions.pins.get("s9") is not None and fleet.sessions.pins.get("s0") is None


def _cache_aware() -> CacheAware:
    settings = CacheAwareSettings(kv_events_port=5557)
    return CacheAware(settings, index=KVBlockIndex(10_000), tree=ApproxPrefixTree(1 << 20))


def _pinned_away_from_the_cache(last_prompt: int) -> tuple[Fleet, Worker, Worker]:
    """A cache_aware fleet whose other prefill holds the whole prompt and whose pinned one
    nothing; the session's last prompt: ``last_prompt`` tokens."""
    policy = _cache_aware()
    fleet = Fleet(policy)
    home, elsewhere = fleet.prefills
    policy.index.apply_stored((elsewhere.id, 0), [1, 2, 3, 4], None, TOKENS, 4)
    fleet.sessions.pins.pin(SESSION.key, home.id, 0, "d0", last_prompt)
    return fleet, home, elsewhere


def test_cache_aware_keeps_the_pin_unless_its_choice_saves_more_than_the_last_prompt() -> None:
    features = RequestFeatures(text="x", tokens=TOKENS)
    fleet, home, elsewhere = _pinned_away_from_the_cache(16)
    assert where(fleet.route(session=None, features=features))[0] == elsewhere.id
    # the pin is worth the session's last prompt, 16 tokens: as much as the other saves
    kept = fleet.route(features=features)
    assert kept.prefill is home and kept.choice is not None and kept.choice.how == "load"
    assert fleet.counted("hit") == 1
    # the request's prompt is now predicted at the pinned rank: the next turn stays there
    assert fleet.route(features=RequestFeatures(text="x", tokens=[*TOKENS, 1])).prefill is home
    # a last prompt of 8 tokens is worth less than the 16 the other saves: the cost model wins
    fleet, home, elsewhere = _pinned_away_from_the_cache(8)
    assert fleet.route(features=features).prefill is elsewhere
    assert fleet.counted("repinned", "policy") == 1
    # and the session follows its new pin
    assert fleet.route(features=features).prefill is elsewhere


def test_explain_shows_the_pin_and_the_table_without_pinning() -> None:
    fleet = Fleet(max_entries=7, ttl_s=30)
    prefill, decode = where(fleet.route())
    explained = fleet.chooser.explain(None, SESSION)
    session = explained["session"]
    assert session["table"] == {"entries": 1, "max_entries": 7, "ttl_s": 30, "evicted": 0}
    pin = session["pin"]
    assert (pin["prefill"], pin["dp_rank"], pin["decode"]) == (
        "http://127.0.0.1:9000" if prefill == "p0" else "http://127.0.0.1:9001",
        0,
        "http://127.0.0.1:9000" if decode == "d0" else "http://127.0.0.1:9001",
    )
    assert explained["choice"]["prefill"] == pin["prefill"]
    assert fleet.chooser.explain(None, SessionAsk("unknown"))["session"]["pin"] is None
    assert len(fleet.sessions.pins) == 1  # explaining pinned nothing


def test_a_session_that_moves_to_another_model_re_pins_in_its_pool_even_when_hard() -> None:
    """Workers 0 serve model a, workers 1 model b: a session pinned (hard) on a's workers that
    asks for b is re-pinned on b's (its pin is gone for b, not a busy worker to wait for)."""
    fleet = Fleet(mode="hard")
    for index, name in enumerate("ab"):
        for worker in (fleet.prefills[index], fleet.decodes[index]):
            fleet.pool.set_models(worker, frozenset({name}), declared=True)
    choosers = {
        name: RouteChooser(
            fleet.pool,
            False,
            build_policy("round_robin"),
            build_policy("round_robin"),
            fleet.metrics,
            CacheAwareSettings(),
            Featurizer(None),
            fleet.circuits,
            fleet.sessions,
            name,
        )  # fmt: skip
        for name in "ab"
    }

    def route(model: str) -> tuple[str | None, str]:
        return where(choosers[model].route(set(), None, count=True, session=SESSION))

    assert route("a") == ("p0", "d0")
    assert route("b") == ("p1", "d1")
    assert fleet.counted("repinned", "gone") == 1
    assert route("b") == ("p1", "d1")


@pytest.mark.parametrize("name", ["least_load", "power_of_two"])
def test_a_soft_pin_holds_under_the_load_policies_too(name: str) -> None:
    """Under least_load and power_of_two the pinned rank is taken as it is: the session stays
    while its prefill carries a little more load than the other (within the load bound)."""
    fleet = Fleet(prefill_policy=build_policy(name))
    first = where(fleet.route())
    pinned = fleet.pool.get(first[0] or "")
    assert pinned is not None
    pinned.inflight = pinned.rank_inflight[0] = 1  # alone, the policy takes the other prefill
    assert {where(fleet.route(session=None))[0] for _ in range(4)} == (
        {w.id for w in fleet.prefills} - {pinned.id}
    )
    for _ in range(4):
        assert where(fleet.route()) == first
    assert fleet.counted("hit") == 4
