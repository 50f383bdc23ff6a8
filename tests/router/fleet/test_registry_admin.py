"""The registry inside the router: admin REST, workers joining/leaving/draining at runtime."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from router import create_app
from testkit.fake_cluster import FakeClusterFactory, settings_for
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import run_server
from tests.router.pipeline.test_protocols import COMPLETION


def _workers(url: str, **kwargs: Any) -> list[dict[str, Any]]:
    response = httpx.get(url + "/admin/workers", timeout=5, **kwargs)
    assert response.status_code == 200, response.text
    workers: list[dict[str, Any]] = response.json()["workers"]
    return workers


def test_admin_lists_cli_workers_with_live_state(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("vllm-mooncake", dp_size=2)
    workers = {w["role"]: w for w in _workers(cluster.router_url)}
    assert workers["prefill"]["url"] == cluster.prefill_urls[0]
    assert workers["prefill"]["source"] == "static"
    assert workers["prefill"]["live"]["healthy"] is True
    assert workers["prefill"]["live"]["dp_size"] == 2
    assert workers["decode"]["live"]["inflight"] == 0
    layout = httpx.get(cluster.router_url + "/admin/layout", timeout=5).json()
    ranks = layout["prefill"][0]["ranks"]
    assert [r["engine_id"] for r in ranks] == cluster.prefills[0].engine_ids


def test_worker_added_through_admin_gets_traffic_within_a_second(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang")
    extra = FakeEngine("decode", "sglang", config=FakeConfig(kv_timeout=20.0))
    with run_server(extra.app) as port, cluster.client() as client:
        url = f"http://127.0.0.1:{port}"
        added = client.post("/admin/workers", json={"role": "decode", "url": url})
        assert added.status_code == 201, added.text
        started = time.monotonic()

        def extra_serves() -> bool:
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
            return bool(extra.records)

        wait_until(extra_serves, 1.0, "the added decode to receive a request")
        assert time.monotonic() - started < 1.0
        worker_id = added.json()["id"]
        assert client.delete(f"/admin/workers/{worker_id}").status_code == 204
        wait_until(
            lambda: all(w["url"] != url for w in cluster.ready_body()["decode"]),
            1.0,
            "the removed decode to leave the pool",
        )
        served = len(extra.records)
        for _ in range(4):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(extra.records) == served


def test_admin_errors(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        for body in (
            {"role": "router", "url": "http://127.0.0.1:1"},
            {"role": "decode", "url": "ftp://x"},
            {"role": "decode"},
            {"role": "decode", "url": "http://a:1", "x": 1},
        ):
            response = client.post("/admin/workers", json=body)
            assert response.status_code in (400, 422), body
            assert response.json()["error"]["message"]
        assert client.delete("/admin/workers/nope").status_code == 404
        assert client.post("/admin/workers/nope/drain").status_code == 404
        assert client.post("/admin/workers", content=b"{bad").status_code in (400, 422)


def test_admin_token(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", registry={"admin_token": "s3cret"})
    assert httpx.get(cluster.router_url + "/admin/workers").status_code == 401
    wrong = {"authorization": "Bearer nope"}
    assert httpx.get(cluster.router_url + "/admin/workers", headers=wrong).status_code == 401
    good = {"authorization": "Bearer s3cret"}
    assert len(_workers(cluster.router_url, headers=good)) == 2


def test_drain_lets_live_stream_finish_then_removes_worker(
    make_cluster: FakeClusterFactory,
) -> None:
    def config() -> FakeConfig:
        return FakeConfig(check_kv=False, tokens=30, token_delay=0.03)

    cluster = make_cluster("sglang", decode=2, config=config)
    target = next(w for w in _workers(cluster.router_url) if w["url"] == cluster.decode_urls[0])
    streamed: dict[str, Any] = {}

    def stream() -> None:
        with httpx.Client(base_url=cluster.router_url, timeout=20) as client:
            # round robin: send until the stream lands on the decode we will drain
            for _ in range(4):
                body = {**COMPLETION, "max_tokens": 30, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as response:
                    if cluster.decodes[0].records and not streamed:
                        streamed["started"] = True
                        streamed["text"] = response.read().decode()
                        return
                    response.read()

    thread = threading.Thread(target=stream)
    thread.start()
    wait_until(lambda: bool(streamed.get("started")), 10, "a stream on the target decode")
    # (the stream is still running: 30 tokens x 30 ms)
    response = httpx.post(f"{cluster.router_url}/admin/workers/{target['id']}/drain", timeout=5)
    assert response.status_code == 202 and response.json()["draining"] is True
    before = len(cluster.decodes[0].records)
    with cluster.client() as client:
        for _ in range(4):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert len(cluster.decodes[0].records) == before  # no new request reached the drained one
    thread.join(timeout=20)
    assert streamed["text"].rstrip().endswith("data: [DONE]")  # the live stream finished
    wait_until(
        lambda: all(w["id"] != target["id"] for w in _workers(cluster.router_url)),
        5,
        "the drained worker to be removed once idle",
    )


def test_router_with_zero_workers_becomes_ready_when_added() -> None:
    prefill, decode = FakeEngine("prefill", "sglang"), FakeEngine("decode", "sglang")
    with (
        run_server(prefill.app) as p_port,
        run_server(prefill.bootstrap_app) as b_port,
        run_server(decode.app) as d_port,
        run_server(create_app(settings_for("sglang", [], []))) as r_port,
    ):
        url = f"http://127.0.0.1:{r_port}"
        response = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=5)
        assert response.status_code == 503
        assert "no healthy prefill worker" in response.json()["error"]["message"]
        for body in (
            {"role": "prefill", "url": f"http://127.0.0.1:{p_port}", "bootstrap_port": b_port},
            {"role": "decode", "url": f"http://127.0.0.1:{d_port}"},
        ):
            assert httpx.post(url + "/admin/workers", json=body).status_code == 201
        wait_until(lambda: httpx.get(url + "/ready").status_code == 200, 1.0, "ready")
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=5).status_code == 200


@pytest.mark.parametrize(
    "host,loopback",
    [("127.0.0.1", True), ("::1", True), ("10.0.0.1", False), (None, False), ("x", False)],
)
def test_loopback_rule(host: str | None, loopback: bool) -> None:
    from registry.admin import _is_loopback

    assert _is_loopback(host) is loopback


async def test_self_registered_worker_lives_while_it_heartbeats() -> None:
    import asyncio

    from registry.client import RegistryClient
    from testkit.servers import arun_server

    prefill, decode = FakeEngine("prefill", "sglang"), FakeEngine("decode", "sglang")
    settings = settings_for("sglang", [], [])
    async with (
        arun_server(prefill.app) as p_port,
        arun_server(prefill.bootstrap_app) as b_port,
        arun_server(decode.app) as d_port,
        arun_server(create_app(settings)) as r_port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{r_port}", timeout=5) as http,
        RegistryClient(f"http://127.0.0.1:{r_port}") as registry,
    ):

        async def ready() -> bool:
            return (await http.get("/ready")).status_code == 200

        async def until(predicate: Any, timeout: float, what: str) -> None:
            deadline = time.monotonic() + timeout
            while not await predicate():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.02)

        # the prefill registers itself with a 1 s lease and keeps heartbeating
        async with registry.registered(
            "prefill", f"http://127.0.0.1:{p_port}", lease_s=1, bootstrap_port=b_port
        ) as record:
            assert record["source"] == "engine"
            await registry.register(
                {"role": "decode", "url": f"http://127.0.0.1:{d_port}", "lease_s": 1}
            )  # the decode registers once, never beats
            await until(ready, 2, "both workers to be routable")
            await until(lambda: _gone(http, "decode"), 4, "the silent decode's lease to expire")
            workers = (await http.get("/ready")).json()["prefill"]
            assert [w["url"] for w in workers] == [f"http://127.0.0.1:{p_port}"]
        await until(lambda: _gone(http, "prefill"), 2, "deregistration on exit")


async def _gone(http: httpx.AsyncClient, role: str) -> bool:
    return not (await http.get("/ready")).json()[role]
