"""``pd-cluster --router-replicas 2``: two router replicas behind a real HAProxy (round robin per
connection) on the cluster's port, each hearing the other; the sync off on request. HAProxy
comes from Debian (scripts/setup-test.sh installs it)."""

from __future__ import annotations

import re
import signal
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
    config = haproxy_config(8000, layout.ports)
    assert "bind 127.0.0.1:8000" in config and "balance roundrobin" in config
    assert re.findall(r"server r(\d) 127\.0\.0\.1:(\d+)", config) == [
        ("0", "8101"), ("1", "8102"), ("2", "8103"),
    ]  # fmt: skip
