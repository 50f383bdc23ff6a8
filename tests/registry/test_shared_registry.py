"""Routers sharing one real etcd: each sees the other's workers; etcd outages don't stop serving."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import httpx

from testkit.etcd_server import EtcdServer
from testkit.fake_engine import FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_server
from tests.router.pipeline.test_protocols import COMPLETION


@contextlib.contextmanager
def _router(registry: str, *worker_args: str) -> Iterator[str]:
    """A real ``router`` process; yields its URL once it answers /health."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "router",
        "--engine",
        "sglang",
        "--port",
        str(port),
        "--registry",
        registry,
        "--health-interval",
        "0.2",
        "--log-level",
        "warning",
        *worker_args,
    ]
    with http_process(argv, url):
        yield url


@contextlib.contextmanager
def _engines() -> Iterator[tuple[FakeEngine, FakeEngine, list[str]]]:
    prefill, decode = FakeEngine("prefill", "sglang"), FakeEngine("decode", "sglang")
    with (
        run_server(prefill.app) as p_port,
        run_server(prefill.bootstrap_app) as b_port,
        run_server(decode.app) as d_port,
    ):
        args = [
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            str(b_port),
            "--decode",
            f"http://127.0.0.1:{d_port}",
        ]
        yield prefill, decode, args


def _ready(url: str) -> bool:
    return httpx.get(url + "/ready", timeout=2).status_code == 200


def test_two_routers_share_workers_through_etcd(private_etcd: EtcdServer) -> None:
    registry = f"{private_etcd.url}/shared-{time.monotonic_ns()}"
    extra = FakeEngine("decode", "sglang")
    with (
        _engines() as (_, decode, args),
        run_server(extra.app) as extra_port,
        _router(registry, *args) as first,
        _router(registry) as second,  # no CLI workers: everything comes from etcd
    ):
        wait_until(lambda: _ready(second), 5, "router B to learn router A's workers")
        response = httpx.post(second + "/v1/completions", json=COMPLETION, timeout=10)
        assert response.status_code == 200
        assert len(decode.records) == 1
        added = httpx.post(
            first + "/admin/workers",
            timeout=5,
            json={"role": "decode", "url": f"http://127.0.0.1:{extra_port}"},
        )
        assert added.status_code == 201

        def b_routes_to_extra() -> bool:
            response = httpx.post(second + "/v1/completions", json=COMPLETION, timeout=10)
            assert response.status_code == 200
            return bool(extra.records)

        wait_until(b_routes_to_extra, 2, "router B to send traffic to the worker added via A")
        ids = {w["id"] for w in httpx.get(second + "/admin/workers").json()["workers"]}
        assert added.json()["id"] in ids


def test_routing_survives_etcd_outage_and_resyncs(private_etcd: EtcdServer) -> None:
    registry = f"{private_etcd.url}/outage-{time.monotonic_ns()}"
    extra = FakeEngine("decode", "sglang")
    with (
        _engines() as (_, decode, args),
        run_server(extra.app) as extra_port,
        _router(registry, *args) as url,
    ):
        wait_until(lambda: _ready(url), 5, "ready")
        private_etcd.stop()
        wait_until(
            lambda: httpx.get(url + "/ready").json()["registry"]["ok"] is False,
            10,
            "the router to notice etcd is gone",
        )
        body = httpx.get(url + "/ready").json()
        assert body["status"] == "ready" and body["registry"]["error"]
        for _ in range(5):  # the last known workers keep serving
            response = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10)
            assert response.status_code == 200
        private_etcd.start()
        wait_until(
            lambda: httpx.get(url + "/ready").json()["registry"]["ok"] is True,
            15,
            "the router to resynchronise with etcd",
        )
        response = httpx.post(
            url + "/admin/workers",
            timeout=5,
            json={"role": "decode", "url": f"http://127.0.0.1:{extra_port}"},
        )
        assert response.status_code == 201
        wait_until(
            lambda: any(
                w["url"].endswith(str(extra_port))
                for w in httpx.get(url + "/ready").json()["decode"]
            ),
            2,
            "a worker added after the outage to join",
        )
        assert len(decode.records) >= 5
