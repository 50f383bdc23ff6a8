"""``pd-cluster --router-replicas 2``: two router replicas behind a real HAProxy (round robin per
connection) on the cluster's port, each hearing the other; the sync off on request; one killed
mid-traffic fails only what it was serving, and its new run rejoins. HAProxy
comes from Debian (scripts/setup-test.sh installs it)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from testkit.polling import wait_until
from tests.worker.test_pd_cluster_behaviour import (
    _alive,
    _children,
    _closed_port,
    _post,
    _start_pd_cluster,
    _stop,
    _wait_ready,
)
from worker.cluster_replicas import ReplicaLayout, haproxy_config, sync_args


def _replica_urls(logs: Path) -> list[str]:
    ports = re.findall(r"server r\d+ 127\.0\.0\.1:(\d+)", (logs / "haproxy.cfg").read_text())
    return [f"http://127.0.0.1:{port}" for port in ports]


def _served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.findall(r'^pdr_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', text, re.M)
    return sum(float(value) for value in found)


def _hears(url: str) -> list[str]:
    replicas = httpx.get(f"{url}/status/data", timeout=5).json()["replicas"] or {}
    return [peer["replica"] for peer in replicas.get("peers", []) if peer["fresh"]]


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "no-sync"])
@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_two_replicas_behind_haproxy_serve_the_cluster_port(tmp_path: Path, sync: bool) -> None:
    port, logs = _closed_port(), tmp_path / "logs"
    flags = ["--router-replicas", "2", "--log-dir", str(logs)]
    proc = _start_pd_cluster(tmp_path, port, *flags, *([] if sync else ["--no-replica-sync"]))
    children: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, tmp_path, url)
        children = _children(proc.pid)
        assert len(children) == 5, children  # two routers, HAProxy, a prefill, a decode
        for _ in range(8):  # a connection each: round robin over the replicas
            response = _post(url, "/v1/completions", {"prompt": "hello"})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["kv_bytes_received"] > 0  # PD through either
        replicas = _replica_urls(logs)
        assert [_served(u) for u in replicas] == [4.0, 4.0]
        if sync:
            wait_until(lambda: _hears(replicas[0]) == ["r1"], 10, "r0 hears r1")
            assert _hears(replicas[1]) == ["r0"]
        else:
            assert httpx.get(f"{replicas[0]}/status/data").json()["replicas"] is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        wait_until(lambda: not any(_alive(pid) for pid in children), 5.0, "children gone")
    finally:
        _stop(proc, children)


def test_the_replicas_follow_each_other_and_haproxy_round_robins() -> None:
    layout = ReplicaLayout([8101, 8102, 8103], [9101, 9102, 9103], token="t" * 32)
    assert sync_args(layout, 1, True) == [
        "--replica-id", "r1", "--replica-token", "t" * 32,
        "--replica-listen", "127.0.0.1:9102",
        "--replica-peer", "127.0.0.1:9101", "--replica-peer", "127.0.0.1:9103",
    ]  # fmt: skip
    assert sync_args(layout, 1, False) == []
    config = haproxy_config(8000, layout.ports, Path("/run/haproxy.sock"))
    assert "bind 127.0.0.1:8000" in config and "balance roundrobin" in config
    assert re.findall(r"server r(\d) 127\.0\.0\.1:(\d+)", config) == [
        ("0", "8101"), ("1", "8102"), ("2", "8103"),
    ]  # fmt: skip


def _replica_pid(parent: int, replica: str) -> int:
    return next(
        pid
        for pid in _children(parent)
        if f"--replica-id\x00{replica}\x00".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    )


def _clients(url: str, seconds: float, results: list[tuple[float, int]]) -> list[threading.Thread]:
    """Two clients sending one request after another, each on a new connection, for
    ``seconds``: (time, status) each, status 0 for a transport error."""

    def client() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                status = _post(url, "/v1/completions", {"prompt": "hello"}, timeout=10).status_code
            except httpx.HTTPError:
                status = 0
            results.append((time.monotonic(), status))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_a_replica_killed_mid_traffic_fails_only_its_own_requests_and_rejoins(
    tmp_path: Path,
) -> None:
    port, logs = _closed_port(), tmp_path / "logs"
    flags = ["--router-replicas", "2", "--restart-workers", "--log-dir", str(logs)]
    proc = _start_pd_cluster(tmp_path, port, *flags)
    children: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, tmp_path, url)
        children = _children(proc.pid)
        first, second = _replica_urls(logs)
        wait_until(lambda: _hears(first) == ["r1"], 10, "r0 hears r1")
        results: list[tuple[float, int]] = []
        threads = _clients(url, 8.0, results)
        wait_until(lambda: len(results) >= 10, 10, "traffic through both replicas")
        os.killpg(_replica_pid(proc.pid, "r1"), signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(20)
        failed = [at for at, status in results if status != 200]
        assert len(failed) <= 2, results  # at most the one request each client had on r1
        assert all(at - killed_at < 1.0 for at in failed)
        assert sum(1 for at, status in results if status == 200 and at > killed_at + 1) > 10
        # pd-cluster starts it again; r0 hears the new run within 5 s of its start
        wait_until(lambda: _served_or_none(second) is not None, 20, "r1 restarted")
        restarted_at = time.monotonic()
        wait_until(lambda: _restarts(first) == 1 and _hears(first) == ["r1"], 5, "r1 rejoined")
        assert time.monotonic() - restarted_at < 5
    finally:
        _stop(proc, children)


def _served_or_none(url: str) -> float | None:
    try:
        return _served(url)
    except httpx.HTTPError:
        return None


def _restarts(url: str) -> int:
    replicas = httpx.get(f"{url}/status/data", timeout=5).json()["replicas"] or {}
    return sum(int(peer["restarts"]) for peer in replicas.get("peers", []))
