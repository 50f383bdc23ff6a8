"""An etcd outage does not take out prefills that registered their ranks with the router's
registry: the router keeps routing to their last known layout until the store is back."""

from __future__ import annotations

import time
import uuid

import pytest

from testkit.etcd_server import EtcdServer
from testkit.fake_cluster import FakeClusterFactory
from testkit.fake_engine import EngineProtocol, FakeConfig
from testkit.servers import free_port
from tests.test_protocols import COMPLETION
from tests.test_registry_bootstrap import _register_sglang, _register_vllm

OUTAGE_S = 3.0  # 15 probe intervals of 0.2 s: far past any probe threshold


@pytest.mark.etcd
@pytest.mark.parametrize("engine", ["vllm-mooncake", "sglang"])
def test_namespace_prefills_keep_serving_through_an_etcd_outage(
    make_cluster: FakeClusterFactory, etcd: EtcdServer, engine: EngineProtocol
) -> None:
    port = free_port()
    cluster = make_cluster(
        engine,
        dp_size=2 if engine == "sglang" else 1,  # as the prefill registers its ranks
        ready=False,
        config=lambda: FakeConfig(check_kv=False),
        prefill_namespace="p1",
        registry={
            "url": f"{etcd.url}/pdr-test/{uuid.uuid4().hex}",
            "bootstrap_ports": {"p1": port},
            "advertise_host": "127.0.0.1",
        },
    )
    if engine == "sglang":
        _register_sglang(port)
    else:
        _register_vllm(port, "eng-A", tp_size=1)
    cluster.wait_ready()
    etcd.stop()
    statuses: list[int] = []
    with cluster.client() as client:
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            statuses.append(client.post("/v1/completions", json=COMPLETION).status_code)
        ready = client.get("/ready")
    assert set(statuses) == {200}, statuses
    assert ready.status_code == 200 and ready.json()["registry"]["ok"] is False
