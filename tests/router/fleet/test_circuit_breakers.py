"""Circuit breakers per worker and per prefill->decode pair: the state machine on a fake clock,
then a router in front of fake engines (real servers on 127.0.0.1) routing around an open
breaker and recovering through a half-open trial request, not through health probes."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.fleet.circuit_breaker import BreakerPolicy, CircuitBreaker, Circuits, CircuitState
from router.server.cli import parse_args
from router.workers import Role, Worker
from testkit.fake_base import Admission, Call, EngineError
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeEngine
from testkit.polling import wait_until

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
POLICY = BreakerPolicy(failure_threshold=3, open_s=5.0, max_open_s=60.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _breaker(
    policy: BreakerPolicy = POLICY,
) -> tuple[CircuitBreaker, FakeClock, list[tuple[str, str]]]:
    clock = FakeClock()
    heard: list[tuple[str, str]] = []
    breaker = CircuitBreaker(
        policy, clock=clock, listener=lambda state, reason: heard.append((state.value, reason))
    )
    return breaker, clock, heard


# --------------------------------------------------------------------------- state machine


def test_opens_after_threshold_failures_in_a_row_and_a_success_resets_the_count() -> None:
    breaker, _, heard = _breaker()
    for _ in range(2):
        breaker.failure("HTTP 500")
    breaker.success()  # not in a row any more
    breaker.failure("HTTP 500")
    breaker.failure("HTTP 500")
    assert breaker.state() is CircuitState.CLOSED and breaker.allows()
    breaker.failure("timed out")
    assert breaker.state() is CircuitState.OPEN and not breaker.allows()
    assert heard == [("open", "3 requests in a row failed (last: timed out); next trial in 5s")]
    assert breaker.retry_in() == 5.0


def test_half_open_after_the_back_off_lets_exactly_one_trial_through() -> None:
    breaker, clock, heard = _breaker()
    for _ in range(3):
        breaker.failure("HTTP 500")
    clock.now += 4.9
    assert not breaker.allows() and not breaker.begin_trial()
    clock.now += 0.1
    assert breaker.allows()
    assert heard[-1] == ("half_open", "open for 5s: one trial request may go through")
    assert breaker.begin_trial()
    assert not breaker.allows() and not breaker.begin_trial()  # one trial at a time
    breaker.end_trial()  # it ended without a verdict (the client left, the engine was full)
    assert breaker.allows() and breaker.begin_trial()
    breaker.success()
    assert breaker.state() is CircuitState.CLOSED and breaker.allows()
    assert heard[-1] == ("closed", "a request succeeded while half-open")


def test_failed_trials_double_the_back_off_up_to_the_cap_and_a_success_resets_it() -> None:
    breaker, clock, _ = _breaker()
    for _ in range(3):
        breaker.failure("HTTP 500")
    waits = []
    for _ in range(6):
        waits.append(breaker.retry_in())
        clock.now += breaker.retry_in() or 0.0
        assert breaker.begin_trial()
        breaker.failure("HTTP 500")  # one failed trial re-opens it at once
    assert waits == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    clock.now += 60.0
    breaker.success()
    for _ in range(3):
        breaker.failure("HTTP 500")
    assert breaker.retry_in() == 5.0


def test_results_of_requests_sent_before_it_opened_are_ignored_while_open() -> None:
    breaker, clock, _ = _breaker()
    for _ in range(3):
        breaker.failure("HTTP 500")
    breaker.success()  # a slow request routed earlier finished now
    breaker.failure("HTTP 500")
    assert breaker.state() is CircuitState.OPEN and breaker.retry_in() == 5.0
    clock.now += 5.0
    assert breaker.state() is CircuitState.HALF_OPEN


def _worker(role: Role, port: int) -> Worker:
    return Worker(role, f"http://127.0.0.1:{port}", id=f"{role.value}-{port}", healthy=True)


def test_circuits_forget_the_breakers_of_workers_that_left() -> None:
    prefill, decode, other = (
        _worker(Role.PREFILL, 1),
        _worker(Role.DECODE, 2),
        _worker(Role.DECODE, 3),
    )
    live = {prefill.id, decode.id, other.id}
    transitions: list[tuple[str, CircuitState]] = []
    circuits = Circuits(
        BreakerPolicy(1, 5.0, 60.0),
        BreakerPolicy(1, 5.0, 60.0),
        live_ids=lambda: live,
        clock=FakeClock(),
        on_transition=lambda scope, to: transitions.append((scope, to)),
    )
    circuits.worker_failure(decode, "HTTP 500")
    circuits.pair_failure(prefill, other, "kv_timeout")
    assert not circuits.worker_allows(decode) and not circuits.pair_allows(prefill, other)
    assert circuits.worker_allows(other) and circuits.pair_allows(prefill, decode)
    assert transitions == [("worker", CircuitState.OPEN), ("pair", CircuitState.OPEN)]
    described = [t.describe() for t in circuits.tripped()]
    assert [(d["scope"], d["state"], d["retry_in_s"]) for d in described] == [
        ("worker", "open", 5.0),
        ("pair", "open", 5.0),
    ]
    live.discard(other.id)  # the decode left the pool: its pair goes too
    assert [t.scope for t in circuits.tripped()] == ["worker"]
    assert circuits.pair_states() == []


def test_no_pair_breakers_when_their_threshold_is_zero() -> None:
    prefill, decode = _worker(Role.PREFILL, 1), _worker(Role.DECODE, 2)
    circuits = Circuits(BreakerPolicy(1, 5.0, 60.0), None)
    for _ in range(5):
        circuits.pair_failure(prefill, decode, "kv_timeout")
    assert circuits.pair_allows(prefill, decode) and circuits.tripped() == []


# --------------------------------------------------------------------------- end to end


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _metric(client: httpx.Client, name: str, **labels: str) -> float | None:
    return _samples(client.get("/metrics").text).get((name, tuple(sorted(labels.items()))))


def _circuits(cluster: FakeCluster) -> list[dict[str, Any]]:
    circuits: list[dict[str, Any]] = cluster.ready_body()["circuits"]
    return circuits


def _break_path(decode: FakeEngine, prefill_port: int) -> dict[str, bool]:
    """Make ``decode`` fail every KV read from the prefill on ``prefill_port`` (a broken network
    path between the two: both answer everything else); set ``["broken"]`` False to fix it."""
    path = {"broken": True}
    admit = decode.handler.admit

    async def admit_unless_broken(call: Call) -> Admission:
        params = call.body.get("kv_transfer_params") or {}
        if path["broken"] and params.get("remote_port") == prefill_port:
            raise EngineError(500, f"NIXL read from port {prefill_port} failed: no route to host")
        return await admit(call)

    decode.handler.admit = admit_unless_broken  # type: ignore[method-assign]
    return path


def _post_n(client: httpx.Client, count: int) -> list[int]:
    return [client.post("/v1/completions", json=COMPLETION).status_code for _ in range(count)]


def test_a_broken_path_between_healthy_workers_opens_the_pair_and_recovers_half_open(
    make_cluster: FakeClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Decode D fails every transfer from prefill A but none from B. After two failures the pair
    A->D opens: requests that pick A go to B instead while A and D stay healthy. After the
    back-off one trial goes A->D; it fails (back-off doubled) and its request is served by B;
    once the path is fixed the next trial succeeds and traffic returns to A."""
    cluster = make_cluster(
        "vllm-nixl",
        prefill=2,
        health={"interval_s": 60.0, "failure_threshold": 3},
        breaker={"open_s": 1.0, "pair_failure_threshold": 2},
    )
    bad, good = cluster.prefills
    bad_url, decode_url = cluster.prefill_urls[0], cluster.decode_urls[0]
    path = _break_path(cluster.decodes[0], int(bad_url.rsplit(":", 1)[1]))
    caplog.set_level(logging.INFO, logger="router.fleet.circuit_breaker")
    with cluster.client() as client:
        assert _post_n(client, 4) == [500, 200, 500, 200]  # round robin: A, B, A, B
        assert len(bad.records) == 2
        opened = _circuits(cluster)
        assert [(c["scope"], c["prefill"], c["decode"], c["state"]) for c in opened] == [
            ("pair", bad_url, decode_url, "open")
        ]
        assert "2 requests in a row failed" in opened[0]["reason"]
        assert opened[0]["retry_in_s"] <= 1.0
        body = cluster.ready_body()
        assert body["status"] == "ready"
        assert [w["healthy"] for w in body["prefill"] + body["decode"]] == [True, True, True]
        pair = {"prefill": bad_url, "decode": decode_url}
        assert _metric(client, "pdr_pd_pair_circuit_open", **pair) == 1.0
        assert _metric(client, "pdr_circuit_transitions_total", scope="pair", to="open") == 1.0
        # no decode worker breaker opened: D served B's transfers in between
        assert _metric(client, "pdr_worker_circuit_open", role="decode", worker=decode_url) in (
            None,
            0.0,
        )

        sent_to_bad = len(bad.records)
        assert _post_n(client, 4) == [200] * 4  # every request, A's turns included, goes to B
        assert len(bad.records) == sent_to_bad

        wait_until(lambda: _circuits(cluster)[0]["state"] == "half_open", 3, "pair half-open")
        # A's turn comes within two: the one trial, still broken, whose failure its client
        # never sees: it is retried on B before any byte went out
        assert _post_n(client, 2) == [200, 200]
        assert len(bad.records) == sent_to_bad + 1
        [reopened] = _circuits(cluster)
        assert reopened["state"] == "open" and reopened["open_s"] == 2.0

        path["broken"] = False
        wait_until(lambda: _circuits(cluster)[0]["state"] == "half_open", 5, "half-open again")
        assert _post_n(client, 6) == [200] * 6
        assert _circuits(cluster) == []
        assert len(bad.records) >= sent_to_bad + 3  # A has its share of the traffic back
        assert _metric(client, "pdr_pd_pair_circuit_open", **pair) == 0.0
        assert _metric(client, "pdr_circuit_transitions_total", scope="pair", to="closed") == 1.0
    lines = [r.getMessage() for r in caplog.records if r.name == "router.fleet.circuit_breaker"]
    assert [line.split(": ", 1)[0] for line in lines] == [
        f"circuit of pair {bad_url} -> {decode_url} is now {state}"
        for state in ("open", "half_open", "open", "half_open", "closed")
    ]
    cluster.wait_idle()


def test_a_failing_decode_opens_its_breaker_and_a_half_open_trial_brings_it_back(
    make_cluster: FakeClusterFactory,
) -> None:
    """A decode that answers 500 is taken out of routing after two failures in a row, without
    being called unhealthy; once it is fixed a trial request brings it back after the back-off,
    long before any health probe (every 60 s) could."""
    cluster = make_cluster(
        "vllm-nixl",
        decode=2,
        health={"interval_s": 60.0, "failure_threshold": 2},
        breaker={"open_s": 1.0},
    )
    broken, other = cluster.decodes
    broken_url = cluster.decode_urls[0]
    probes = broken.health_checks
    broken.config.fail_status = 500
    with cluster.client() as client:
        assert _post_n(client, 4) == [500, 200, 500, 200]
        [opened] = _circuits(cluster)
        assert (opened["scope"], opened["worker"], opened["state"]) == (
            "worker",
            broken_url,
            "open",
        )
        assert "2 requests in a row failed (last: HTTP 500" in opened["reason"]
        assert cluster.ready_body()["decode"][0]["healthy"] is True  # open, not unhealthy
        assert _metric(client, "pdr_worker_circuit_open", role="decode", worker=broken_url) == 1
        served = len(other.records)
        assert _post_n(client, 4) == [200] * 4
        assert len(other.records) == served + 4  # all of them while the breaker is open

        broken.config.fail_status = None
        wait_until(
            lambda: _circuits(cluster)[0]["state"] == "half_open",
            3,
            "the decode's breaker half-open",
        )
        tried = len(broken.records)
        assert _post_n(client, 4) == [200] * 4
        assert len(broken.records) >= tried + 2  # the trial closed it: back in round robin
        assert _circuits(cluster) == []
        assert _metric(client, "pdr_worker_circuit_open", role="decode", worker=broken_url) == 0
    assert broken.health_checks == probes  # no probe had a part in it
    cluster.wait_idle()


def test_when_every_decode_breaker_is_open_the_client_gets_a_prompt_503(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl", health={"interval_s": 60.0, "failure_threshold": 2})
    cluster.decodes[0].config.fail_status = 500
    with cluster.client() as client:
        assert _post_n(client, 2) == [500, 500]
        response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "service_unavailable"
    assert "circuit breaker of every healthy one is open" in error["message"]
    assert "next trial in" in error["message"]
    assert len(cluster.decodes[0].records) == 2  # the third never reached it


def test_breaker_flags_reach_the_settings_and_a_back_off_cap_below_the_start_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = parse_args(
        ["--breaker-open", "2", "--breaker-max-open", "30", "--pair-failure-threshold", "0"]
    )
    assert (settings.breaker.open_s, settings.breaker.max_open_s) == (2.0, 30.0)
    assert settings.breaker.pair_failure_threshold == 0
    with pytest.raises(SystemExit) as exited:
        parse_args(["--breaker-open", "10", "--breaker-max-open", "5"])
    assert exited.value.code == 2
    assert "--breaker-max-open: the back-off cap (5s) is below" in capsys.readouterr().err
