"""Prefills that register with the router's registry instead of hosting a bootstrap server."""

from __future__ import annotations

import httpx

from testkit.fake_cluster import FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until
from testkit.servers import free_port
from tests.router.pipeline.test_protocols import COMPLETION


def _register_vllm(port: int, engine_id: str, tp_size: int, path: str = "") -> None:
    for tp in range(tp_size):
        response = httpx.post(
            f"http://127.0.0.1:{port}{path}/register",
            timeout=5,
            json={
                "engine_id": engine_id,
                "dp_rank": 0,
                "tp_rank": tp,
                "pp_rank": 0,
                "addr": f"tcp://127.0.0.1:{40000 + tp}",
            },
        )
        assert response.status_code == 200, response.text


def _register_sglang(port: int) -> None:
    """Two DP ranks of a TP-2 SGLang prefill, as its ranks PUT them."""
    for rank in range(2):
        response = httpx.put(
            f"http://127.0.0.1:{port}/route",
            timeout=5,
            json={
                "role": "Prefill",
                "tp_size": 2,
                "dp_size": 2,
                "rank_ip": "127.0.0.1",
                "rank_port": 41000 + rank,
                "engine_rank": rank,
            },
        )
        assert response.status_code == 200, response.text


def test_vllm_prefill_registering_with_the_router(make_cluster: FakeClusterFactory) -> None:
    port = free_port()
    cluster = make_cluster(
        "vllm-mooncake",
        ready=False,
        config=lambda: FakeConfig(check_kv=False),
        prefill_namespace="p1",
        registry={
            "bootstrap_ports": {"p1": port},
            "advertise_host": "127.0.0.1",
            "bootstrap_check_reachable": False,  # the ranks below are addresses only
        },
    )
    assert httpx.get(cluster.router_url + "/ready").status_code == 503  # no ranks yet
    _register_vllm(port, "eng-A", tp_size=2)
    cluster.wait_ready()
    table = httpx.get(f"http://127.0.0.1:{port}/query").json()
    assert table["0"]["engine_id"] == "eng-A" and len(table["0"]["worker_addr"]) == 2
    with cluster.client() as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    params = cluster.decodes[0].records[-1].body["kv_transfer_params"]
    assert params["remote_bootstrap_addr"] == f"http://127.0.0.1:{port}"
    assert params["remote_engine_id"] == "eng-A"
    _register_vllm(port, "eng-B", tp_size=2)  # a restarted prefill: new engine id, new epoch

    def routes_to_new_engine() -> bool:
        with cluster.client() as client:
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        last = cluster.decodes[0].records[-1].body["kv_transfer_params"]
        return bool(last["remote_engine_id"] == "eng-B")

    wait_until(routes_to_new_engine, 5, "the router to use the restarted prefill's engine id")


def test_sglang_prefill_registering_with_the_router(make_cluster: FakeClusterFactory) -> None:
    port = free_port()
    cluster = make_cluster(
        "sglang",
        ready=False,
        config=lambda: FakeConfig(check_kv=False),
        prefill_namespace="p1",
        registry={
            "bootstrap_ports": {"p1": port},
            "advertise_host": "127.0.0.1",
            "bootstrap_check_reachable": False,  # the ranks below are addresses only
        },
    )
    _register_sglang(port)
    cluster.wait_ready()
    assert cluster.ready_body()["prefill"][0]["dp_size"] == 2
    with cluster.client() as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    body = cluster.decodes[0].records[-1].body
    assert (body["bootstrap_host"], body["bootstrap_port"]) == ("127.0.0.1", port)
    assert body["bootstrap_room"] % 2 == body["disagg_prefill_dp_rank"]


def test_vllm_prefill_registering_on_the_shared_bootstrap_port(
    make_cluster: FakeClusterFactory,
) -> None:
    """Without a port of its own, a namespace is reached on the shared ``--bootstrap-port`` under
    ``/bootstrap/NS`` (never on the client port, which serves no engine API)."""
    port = free_port()
    cluster = make_cluster(
        "vllm-mooncake",
        ready=False,
        config=lambda: FakeConfig(check_kv=False),
        prefill_namespace="p1",
        registry={
            "bootstrap_port": port,
            "advertise_host": "127.0.0.1",
            "bootstrap_check_reachable": False,  # the ranks below are addresses only
        },
    )
    _register_vllm(port, "eng-A", tp_size=1, path="/bootstrap/p1")
    cluster.wait_ready()
    with cluster.client() as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    params = cluster.decodes[0].records[-1].body["kv_transfer_params"]
    assert params["remote_bootstrap_addr"] == f"http://127.0.0.1:{port}/bootstrap/p1"
