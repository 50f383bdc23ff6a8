"""``router --workers N``: real router processes under a real supervisor, in front of fake
engines (sglang: its prefill needs no bootstrap port of ours). Each connection below is a new
one, so that SO_REUSEPORT spreads them over the processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_servers

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
STREAM = {**BODY, "stream": True, "max_tokens": 12}


@contextmanager
def supervised(
    *extra: str,
    processes: int = 2,
    config: FakeConfig | None = None,
    prefill_config: FakeConfig | None = None,
    engines: tuple[FakeEngine, FakeEngine] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``router --workers processes`` in front of a fake prefill and decode (``engines``, or
    new ones of these configs), every process on the port."""
    prefill, decode = engines or (
        FakeEngine("prefill", "sglang", config=prefill_config or FakeConfig(check_kv=False)),
        FakeEngine("decode", "sglang", config=config or FakeConfig(check_kv=False)),
    )
    with run_servers(prefill.app, decode.app) as (p_port, d_port):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "router", "--engine", "sglang", "--port", str(port)]
        argv += ["--workers", str(processes), "--health-interval", "0.2"]
        argv += [
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            "--decode",
            f"http://127.0.0.1:{d_port}",
        ]
        with http_process([*argv, *extra], url, path="/ready", timeout=30) as process:
            wait_until(lambda: joined(url) == processes, 20, "every process on the port")
            yield url, process


def fresh(url: str, method: str, path: str, **kwargs: object) -> httpx.Response:
    """One request on a connection of its own."""
    with httpx.Client(base_url=url, timeout=10) as client:
        return client.request(method, path, **kwargs)  # type: ignore[arg-type]


def processes_of(url: str) -> list[dict[str, object]]:
    try:
        found = fresh(url, "GET", "/status/data").json()["processes"]
    except (httpx.HTTPError, KeyError, ValueError):
        return []
    return list(found or [])


def joined(url: str) -> int:
    """Processes that listen on the client port (``processes[].joined``)."""
    return sum(1 for process in processes_of(url) if process.get("joined"))


def requests_counted(url: str) -> float:
    """The merged ``pdr_requests_total`` of completions that succeeded."""
    text = fresh(url, "GET", "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdr_requests_total" and sample.labels.get("status") == "200":
                total += sample.value
    return total


def traffic_counted(url: str) -> int:
    """The requests in ``/status/data``'s recent-traffic window (the status page's chart)."""
    data = fresh(url, "GET", "/status/data").json()
    assert all("traffic" not in process for process in data["processes"])
    return sum(int(bucket["requests"]) for bucket in data["traffic"]["buckets"])


def test_processes_share_the_port_and_give_one_metrics_view() -> None:
    with supervised() as (url, _):
        for _ in range(40):
            assert fresh(url, "POST", "/v1/completions", json=BODY).status_code == 200
        served = {int(p["index"]): int(p["requests_served"]) for p in processes_of(url)}  # type: ignore[call-overload]
        assert sorted(served) == [0, 1]
        assert all(count > 0 for count in served.values()), served  # both took connections
        assert sum(served.values()) == 40
        # every scrape, whichever process answers it, counts all 40
        assert [requests_counted(url) for _ in range(6)] == [40.0] * 6
        assert "pdr_router_processes 2.0" in fresh(url, "GET", "/metrics").text
        # and every status page, whichever process answers it, shows the traffic of all 40
        assert [traffic_counted(url) for _ in range(6)] == [40] * 6


def test_a_process_that_dies_is_restarted_and_the_others_keep_serving() -> None:
    with supervised() as (url, process):
        victim = processes_of(url)[0]
        os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        # new connections go to the process still listening: none is refused
        for _ in range(10):
            assert fresh(url, "POST", "/v1/completions", json=BODY).status_code == 200
        wait_until(
            lambda: (
                {p["index"]: p["pid"] for p in processes_of(url)}.get(victim["index"])
                not in (None, victim["pid"])
            ),
            20,
            "the killed process restarted",
        )
        assert process.poll() is None


def test_a_restarted_process_takes_connections_only_once_it_knows_the_fleet() -> None:
    """Its workers probed (here the prefill's /health takes 1 s) before its socket listens: a
    client never reaches a process that would answer /ready with 503 while its siblings serve."""
    slow_health = FakeConfig(check_kv=False, health_delay=1.0)
    with supervised(prefill_config=slow_health) as (url, _):
        victim = processes_of(url)[0]
        os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        statuses: list[int] = []

        def restarted() -> bool:
            statuses.append(fresh(url, "GET", "/ready").status_code)
            pids = {p["index"]: p["pid"] for p in processes_of(url)}
            return pids.get(victim["index"]) not in (None, victim["pid"])

        wait_until(restarted, 30, "the killed process restarted", interval=0.05)
        statuses += [fresh(url, "GET", "/ready").status_code for _ in range(20)]
        assert set(statuses) == {200}


def test_sigterm_drains_every_process_and_exits_0() -> None:
    slow = FakeConfig(tokens=12, token_delay=0.1, check_kv=False)  # 1.2 s per stream
    with supervised("--shutdown-grace", "20", config=slow) as (url, process):
        children = [int(p["pid"]) for p in processes_of(url)]  # type: ignore[call-overload]
        with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=30) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert first and rest[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in rest)
        assert process.wait(timeout=30) == 0
        wait_until(lambda: not any(_alive(pid) for pid in children), 10, "every process gone")


def test_admin_writes_reach_every_process() -> None:
    with supervised() as (url, _):
        added = fresh(
            url, "POST", "/admin/workers", json={"role": "decode", "url": "http://127.0.0.1:9"}
        )
        assert added.status_code == 201

        def everyone_sees_it() -> bool:
            views = [fresh(url, "GET", "/admin/workers").json()["workers"] for _ in range(8)]
            return all("http://127.0.0.1:9" in {w["url"] for w in view} for view in views)

        wait_until(everyone_sees_it, 10, "the added worker in every process's registry")


def test_shared_socket_mode_serves() -> None:
    with supervised("--worker-sockets", "shared") as (url, _):
        for _ in range(10):
            assert fresh(url, "POST", "/v1/completions", json=BODY).status_code == 200
        assert requests_counted(url) == 10.0


def test_a_process_that_cannot_start_stops_the_router() -> None:
    """A process that fails before it serves (here its bootstrap port is taken) is not restarted
    in a loop: the router exits non-zero."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = free_port()
        argv = [sys.executable, "-m", "router", "--engine", "sglang", "--port", str(port)]
        argv += ["--workers", "2", "--decode", "http://127.0.0.1:9"]
        argv += ["--bootstrap-port", str(taken.getsockname()[1])]
        process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        try:
            assert process.wait(timeout=30) != 0
        finally:
            if process.poll() is None:
                process.kill()
            process.communicate()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("quota", "expected"), [("50000 100000", 1), ("max 100000", None)])
def test_auto_counts_the_cgroup_quota(tmp_path: object, quota: str, expected: int | None) -> None:
    from pathlib import Path

    from router.server.cores import process_count

    root = Path(str(tmp_path))
    (root / "cpu.max").write_text(quota + "\n")
    affinity = len(os.sched_getaffinity(0))
    want = affinity if expected is None else min(expected, affinity)
    assert process_count("auto", root) == want
    assert process_count("3", root) == 3
