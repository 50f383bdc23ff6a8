"""Two real router replicas (``--replica-listen``/``--replica-peer``) in front of the same fake
engines route as one: each counts the other's legs toward the caps and its admission units
toward the fleet's budget; one cut off from its peer keeps routing on its own and says it is
degraded; a message without the token changes nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from router.fleet.replica_sync import LoadSnapshot, ReplicaSync
from router.server.cli import parse_args
from router.settings import ReplicaSettings
from testkit.chromium import Chromium, chromium_available
from testkit.etcd_server import EtcdServer
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_servers
from testkit.tcp_proxy import partition_proxy

TOKEN = "replica-test-token-0123"
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
STREAM = {**BODY, "stream": True, "max_tokens": 12}
SLOW = FakeConfig(tokens=20, token_delay=0.1, check_kv=False)  # 1.2 s per 12-token stream


class Replica:
    def __init__(self, name: str, sync_port: int, peers: list[int], extra: tuple[str, ...]) -> None:
        self.name, self.sync_port, self.peers, self.extra = name, sync_port, peers, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def argv(self, prefill_port: int, decode_port: int) -> list[str]:
        argv = [sys.executable, "-m", "router", "--engine", "sglang", "--port", str(self.port)]
        argv += ["--prefill", f"http://127.0.0.1:{prefill_port}"]
        argv += ["--decode", f"http://127.0.0.1:{decode_port}", "--health-interval", "0.2"]
        argv += ["--replica-id", self.name, "--replica-token", TOKEN]
        argv += ["--replica-listen", f"127.0.0.1:{self.sync_port}"]
        for peer in self.peers:
            argv += ["--replica-peer", f"127.0.0.1:{peer}"]
        return [*argv, *self.extra]


@contextmanager
def engines(config: FakeConfig) -> Iterator[tuple[int, int]]:
    prefill = FakeEngine("prefill", "sglang", config=FakeConfig(check_kv=False))
    decode = FakeEngine("decode", "sglang", config=config)
    with run_servers(prefill.app, decode.app) as (prefill_port, decode_port):
        yield prefill_port, decode_port


@contextmanager
def started(replica: Replica, ports: tuple[int, int]) -> Iterator[subprocess.Popen[str]]:
    with http_process(replica.argv(*ports), replica.url, path="/ready", timeout=30) as process:
        yield process


def status(url: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] = httpx.get(url + "/status/data", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return data


def decode_inflight(url: str) -> int:
    decodes = status(url).get("workers", {}).get("decode", [])
    return int(decodes[0]["inflight"]) if decodes else -1


def hears(url: str, peer: str) -> bool:
    replicas = status(url).get("replicas") or {}
    return any(p["replica"] == peer and p["fresh"] for p in replicas.get("peers", []))


def every_process_hears(url: str, processes: int) -> bool:
    """Each of the replica's ``--workers`` processes listens and hears its one peer."""
    found = status(url).get("processes") or []
    heard = [p for p in found if p["joined"] and (p["replicas"] or {}).get("fresh") == 1]
    return processes == 1 or len(heard) == processes


def sync_metrics(url: str) -> dict[str, float]:
    """``pdr_replica_peers`` by state and ``pdr_replica_degraded`` from ``/metrics``."""
    found: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdr_replica_peers":
                found[sample.labels["state"]] = sample.value
            elif sample.name == "pdr_replica_degraded":
                found["degraded"] = sample.value
    return found


def stream_in_background(url: str, done: list[int]) -> threading.Thread:
    def read() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=30) as reply:
                for _ in reply.iter_lines():
                    pass
                done.append(reply.status_code)
        except httpx.HTTPError:
            done.append(-1)  # its replica died under it

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def breaker_open(url: str) -> bool:
    """A worker's breaker is open in the replica (the process that answers)."""
    circuits = httpx.get(url + "/ready", timeout=5).json()["circuits"]
    return any(c["scope"] == "worker" and c["state"] == "open" for c in circuits)


def post(url: str) -> int:
    return httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code


@contextmanager
def pair(*extra: str, config: FakeConfig = SLOW) -> Iterator[tuple[Replica, Replica, Any]]:
    sync_a, sync_b = free_port(), free_port()
    a = Replica("a", sync_a, [sync_b], extra)
    b = Replica("b", sync_b, [sync_a], extra)
    with engines(config) as ports, ExitStack() as stack:
        processes = {r.name: stack.enter_context(started(r, ports)) for r in (a, b)}
        try:
            wait_until(lambda: hears(a.url, "b") and hears(b.url, "a"), 10, "the replicas hear")
        except AssertionError as exc:  # what each says of its peer, to tell why
            said = {r.name: status(r.url).get("replicas") for r in (a, b)}
            raise AssertionError(f"{exc}: {said}") from None
        yield a, b, (ports, processes)


def test_a_replica_counts_its_peers_legs_toward_the_worker_caps() -> None:
    with pair("--max-inflight-per-decode", "1") as (a, b, _):
        done: list[int] = []
        thread = stream_in_background(a.url, done)
        wait_until(lambda: decode_inflight(b.url) == 1, 10, "b sees a's decode leg")
        assert [post(b.url) for _ in range(4)] == [429] * 4  # the decode is at its cap
        thread.join(30)
        assert done == [200]
        wait_until(lambda: decode_inflight(b.url) == 0, 10, "b sees a's leg end")
        assert post(b.url) == 200


@pytest.mark.parametrize("processes", [1, 2])
def test_the_admission_budget_is_the_fleets(processes: int) -> None:
    """With ``--workers 2`` a's units are its host's (whichever process holds the request)."""
    limits = ("--max-concurrent-requests", "1", "--max-queued-requests", "0")
    with pair(*limits, "--workers", str(processes)) as (a, b, _):
        wait_until(lambda: all(every_process_hears(r.url, processes) for r in (a, b)), 20, "hear")
        for _ in range(2 * processes - 1):  # with 2: requests on either of a's processes (3:
            # both, most likely), each once a no longer counts b's last (its units, as its legs)
            wait_until(lambda: decode_inflight(a.url) == 0, 10, "a sees b's request end")
            done: list[int] = []
            thread = stream_in_background(a.url, done)
            wait_until(lambda: decode_inflight(b.url) == 1, 10, "b sees a's request")
            assert [post(b.url) for _ in range(4)] == [429] * 4
            thread.join(30)
            assert done == [200]
            wait_until(lambda: post(b.url) == 200, 10, "b admits once a's request ended")


def test_a_replica_cut_off_routes_alone_says_degraded_and_reconverges() -> None:
    with pair("--max-inflight-per-decode", "1") as (a, b, (ports, processes)):
        done: list[int] = []
        stream_in_background(a.url, done)
        wait_until(lambda: decode_inflight(b.url) == 1, 10, "b sees a's decode leg")
        assert sync_metrics(b.url) == {"fresh": 1.0, "stale": 0.0, "degraded": 0.0}
        processes["a"].kill()  # a dies with a leg in flight
        cut_at = time.monotonic()
        wait_until(lambda: decode_inflight(b.url) == 0, 10, "b drops a's counts")
        assert time.monotonic() - cut_at < 5
        ready = httpx.get(b.url + "/ready", timeout=5)
        assert ready.status_code == 200  # it routes on its own state
        assert "not heard" in ready.json()["replicas"]["degraded"]
        assert sync_metrics(b.url) == {"fresh": 0.0, "stale": 1.0, "degraded": 1.0}
        assert post(b.url) == 200
        with started(a, ports):  # a again, a new run: b hears it and is whole again
            wait_until(lambda: hears(b.url, "a"), 10, "b hears a again")
            replicas = httpx.get(b.url + "/ready", timeout=5).json()["replicas"]
            assert replicas["degraded"] is None
            assert replicas["peers"][0]["restarts"] == 1


def test_a_replica_cut_off_by_a_partition_hears_its_peer_again_once_it_heals() -> None:
    """b hears a through a link that a partition cuts without a reset (the bytes stop, the
    connection stays open): b says it is degraded, and once the link heals b hears a again on
    a new connection (heartbeats find the dead one) although a never restarted."""
    sync_a, sync_b = free_port(), free_port()
    with partition_proxy(sync_a) as link:
        a = Replica("a", sync_a, [sync_b], ())
        b = Replica("b", sync_b, [link.port], ())
        with engines(SLOW) as ports, started(a, ports), started(b, ports):
            wait_until(lambda: hears(a.url, "b") and hears(b.url, "a"), 10, "the replicas hear")
            link.cut()
            wait_until(lambda: not hears(b.url, "a"), 10, "b stops hearing a")
            assert (
                "not heard" in httpx.get(b.url + "/ready", timeout=5).json()["replicas"]["degraded"]
            )
            link.heal()
            wait_until(lambda: hears(b.url, "a"), 15, "b hears a again")
            (peer,) = status(b.url)["replicas"]["peers"]
            assert peer["restarts"] == 0 and peer["gaps"] > 0  # the same run of a, some missed
            assert status(b.url)["replicas"]["degraded"] is None


def _forger(port: int) -> zmq.Socket[bytes]:
    forger: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    forger.setsockopt(zmq.LINGER, 0)
    forger.bind(f"tcp://127.0.0.1:{port}")
    return forger


def test_a_message_without_the_token_changes_nothing() -> None:
    forged_port = free_port()
    b = Replica("b", free_port(), [forged_port], ("--max-inflight-per-decode", "1"))
    forger = _forger(forged_port)
    try:
        with engines(SLOW) as ports, started(b, ports):
            decode = status(b.url)["workers"]["decode"][0]["id"]
            busy = LoadSnapshot("x", 1.0, 1, time.time(), 0, {decode: ([5], [0])})
            payload = msgspec.msgpack.encode(busy)
            wrong = ReplicaSync.mac(b"not-the-token-at-all", payload)
            wait_until(
                lambda: (
                    forger.send(wrong + payload) is None
                    and status(b.url)["replicas"]["rejected"] > 0
                ),
                10,
                "the forged message refused",
            )
            assert decode_inflight(b.url) == 0 and post(b.url) == 200
            right = ReplicaSync.mac(TOKEN.encode(), payload)
            wait_until(
                lambda: forger.send(right + payload) is None and decode_inflight(b.url) == 5,
                10,
                "the same message with the token taken",
            )
            assert post(b.url) == 429
    finally:
        forger.close()


def test_replica_sync_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (
        {"listen": "127.0.0.1:1"},  # no token
        {"listen": "127.0.0.1:1", "token": "short"},
        {"peers": ["127.0.0.1:2"]},  # peers without our own listen
        {"listen": "nope", "token": TOKEN},
    ):
        try:
            ReplicaSettings.model_validate(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted: {bad}")
    own = ["--replica-listen", "127.0.0.1:1", "--replica-token", TOKEN, "--replica-peers-registry"]
    with pytest.raises(SystemExit):  # the router's own memory:// registry is nobody else's
        parse_args(own)
    assert parse_args([*own, "--registry", "etcd://127.0.0.1:2379"]).replicas.peers_registry
    several = ["--replica-listen", "127.0.0.1:1", "--replica-token", TOKEN, "--workers", "2"]
    assert parse_args(several).server.workers == "2"
    monkeypatch.setenv("PDR_FEATURES__HOST_SHARING", "false")  # process 0 reads the host's board
    with pytest.raises(SystemExit):
        parse_args(several)


def test_a_breaker_opened_by_one_replica_keeps_the_other_away() -> None:
    failing = FakeConfig(check_kv=False, fail_status=500)
    with pair(config=failing) as (a, b, _):
        assert [post(a.url) for _ in range(3)] == [500] * 3  # a's decode breaker opens

        wait_until(lambda: breaker_open(b.url), 10, "b's breaker follows a's")
        answer = httpx.post(b.url + "/v1/completions", json=BODY, timeout=10)
        assert answer.status_code == 503  # b sends the failing decode nothing of its own
        assert "circuit breaker" in answer.json()["error"]["message"]


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_replicas_of_several_processes_route_as_one() -> None:
    """Each replica runs ``--workers 2``: whichever of a's processes takes a stream, every one
    of b's counts its leg toward the cap; a breaker opened in any of a's processes keeps every
    one of b's away."""
    with pair("--workers", "2", "--max-inflight-per-decode", "1") as (a, b, _):
        wait_until(lambda: all(every_process_hears(r.url, 2) for r in (a, b)), 20, "all hear")
        published = [p["replicas"]["publishes"] for p in status(a.url)["processes"]]
        assert sorted(published) == [False, True]  # process 0 publishes for the host
        for _ in range(3):  # streams on either of a's processes (3: both, most likely)
            done: list[int] = []
            thread = stream_in_background(a.url, done)
            wait_until(lambda: decode_inflight(b.url) == 1, 10, "b sees a's decode leg")
            assert [post(b.url) for _ in range(6)] == [429] * 6  # new connections: both processes
            thread.join(30)
            assert done == [200]
            wait_until(lambda: decode_inflight(b.url) == 0, 10, "b sees a's leg end")
        assert post(b.url) == 200


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_a_breaker_opened_in_any_process_of_a_replica_keeps_the_peer_away() -> None:
    failing = FakeConfig(check_kv=False, fail_status=500)
    with pair("--workers", "2", config=failing) as (a, b, _):
        wait_until(lambda: all(every_process_hears(r.url, 2) for r in (a, b)), 20, "all hear")

        # a's processes share the verdict; one of them opens first
        wait_until(lambda: post(a.url) == 503 and breaker_open(a.url), 20, "a's breaker opens")
        # (b sends nothing meanwhile: its breakers can only be a's)
        wait_until(lambda: breaker_open(b.url), 10, "b's breaker follows a's")
        answers = [httpx.post(b.url + "/v1/completions", json=BODY, timeout=10) for _ in range(6)]
        assert [answer.status_code for answer in answers] == [503] * 6  # every process of b
        assert all("circuit breaker" in answer.json()["error"]["message"] for answer in answers)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not chromium_available(), reason="needs Chromium (scripts/setup-test.sh)")
async def test_the_status_page_lists_the_peers_and_says_when_one_is_cut_off(
    tmp_path: Path,
) -> None:
    with pair() as (a, b, (_, processes)):
        async with Chromium(tmp_path) as browser:
            await browser.navigate(f"{b.url}/status")
            row = "document.querySelector('tr[data-replica=\"a\"]')"
            await browser.wait_for(f"{row} && {row}.innerText.includes('yes')", 30, "a heard")
            assert not await browser.evaluate("document.getElementById('replicas-section').hidden")
            processes["a"].kill()
            await browser.wait_for(f"{row}.innerText.includes('stale')", 30, "a stale")
            said = await browser.evaluate("document.getElementById('count-replicas').innerText")
            assert said.startswith("degraded: 1 of 1 replica peer(s) not heard")


@pytest.mark.etcd
def test_replicas_find_each_other_through_the_shared_registry(etcd: EtcdServer) -> None:
    """No peer named on either command line: each registers its address in etcd and follows
    every address registered; one that stops takes its key with it."""
    registry = ("--registry", f"{etcd.url}/pdr-test/{uuid.uuid4().hex}", "--replica-peers-registry")
    a = Replica("a", free_port(), [], registry)
    b = Replica("b", free_port(), [], registry)
    with engines(SLOW) as ports, started(b, ports):
        with started(a, ports):
            wait_until(lambda: hears(a.url, "b") and hears(b.url, "a"), 20, "found via etcd")

        def b_follows_nobody() -> bool:
            return bool(status(b.url)["replicas"]["peer_addresses"] == [])

        wait_until(b_follows_nobody, 20, "a's key gone with it")
        assert httpx.get(b.url + "/ready", timeout=5).json()["replicas"]["degraded"] is None
