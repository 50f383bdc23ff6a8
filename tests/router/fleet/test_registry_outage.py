"""An etcd outage does not take out prefills that registered their ranks with the router's
registry (issue 11 item 4): real ``pd-worker`` processes through ``pd-cluster`` with the router on
etcd. The decodes look every prefill rank up in the router's bootstrap API (vLLM ``GET /query``,
SGLang ``GET /route``) on their first request, which comes only after etcd stopped; the router
keeps probing the prefill's layout meanwhile. Both must answer from the last known ranks. The
prober's own fallback (a store error with no last known table) is checked in-process."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from registry.backends import MemoryStore
from registry.engine_api import RankTables
from router.fleet.health import HealthProber
from router.settings import EngineProtocol, HealthSettings
from router.workers import Role, Worker, WorkerPool
from testkit.cluster_process import ClusterProcess
from testkit.etcd_server import EtcdServer
from testkit.polling import wait_until

PROBE_S = 0.2  # --health-interval; the default --health-unhealthy-threshold is 3
IDLE_S = 1.5  # no traffic, then traffic, each past any probe threshold (0.6 s)
TRAFFIC_S = 1.5
MAX_REQUESTS = 500
BODY = {"model": "sim-model", "prompt": "an etcd outage must not matter", "max_tokens": 4}


@pytest.fixture(params=["vllm-mooncake", "sglang"])
def cluster(request: pytest.FixtureRequest, etcd: EtcdServer, tmp_path: Path) -> Iterator[str]:
    process = ClusterProcess(
        tmp_path / "pd-cluster.log",
        *("--engine", request.param, "--dp", "2", "--no-kv-events", "--ready-timeout", "40"),
        f"--router-arg=--registry={etcd.url}/pdr-test/{uuid.uuid4().hex}",
        f"--router-arg=--health-interval={PROBE_S}",
    )
    try:
        process.wait_ready()
        yield process.url
    finally:
        process.stop()


def _ready(client: httpx.Client) -> dict[str, object]:
    response = client.get("/ready")
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


def _registry_ok(client: httpx.Client) -> bool:
    registry = _ready(client)["registry"]
    assert isinstance(registry, dict)
    return registry["ok"] is True


@pytest.mark.etcd
@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_namespace_prefills_keep_serving_through_an_etcd_outage(
    cluster: str, etcd: EtcdServer
) -> None:
    with httpx.Client(base_url=cluster, timeout=10.0) as client:
        etcd.stop()
        # idle: no request keeps the prefill alive, only the probes (which cannot read etcd)
        deadline = time.monotonic() + IDLE_S
        while time.monotonic() < deadline:
            assert not _registry_ok(client)  # /ready stays 200, and says the registry is down
        statuses: list[int] = []
        deadline = time.monotonic() + TRAFFIC_S
        while time.monotonic() < deadline and len(statuses) < MAX_REQUESTS:
            response = client.post("/v1/completions", json=BODY)
            statuses.append(response.status_code)
            assert response.status_code == 200, (len(statuses), response.text)
            assert response.json()["choices"][0]["text"]
        assert len(statuses) >= 5, statuses
        assert not _registry_ok(client)

        etcd.start()
        wait_until(lambda: _registry_ok(client), 10.0, "registry ok again", interval=0.1)
        assert client.post("/v1/completions", json=BODY).status_code == 200


async def test_a_store_error_keeps_the_prefills_last_known_layout(
    alive_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With no last known table to answer from (the store down from the start), a failed layout
    read is no evidence against a prefill: the prober keeps its layout, warning once. A prefill
    whose layout was never known stays out."""
    store = MemoryStore()
    await store.close()  # every call: RegistryUnavailable
    tables = RankTables()
    tables.bind(store)
    known = Worker(Role.PREFILL, alive_url, id="p1", bootstrap_namespace="p1")
    known.mark_up()
    known.set_layout(2, ("e0", "e1"))
    unknown = Worker(Role.PREFILL, alive_url, id="p2", bootstrap_namespace="p2")
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=True)
    pool.add(known, None)
    pool.add(unknown, None)
    settings = HealthSettings(unhealthy_threshold=1, healthy_threshold=1)
    prober = HealthProber(pool, EngineProtocol.VLLM_MOONCAKE, settings, tables)
    try:
        for _ in range(5):
            await prober.probe_all()
            assert (known.healthy, known.dp_size, known.engine_ids) == (True, 2, ("e0", "e1"))
            assert not unknown.healthy
    finally:
        await prober.aclose()
    kept = [r for r in caplog.records if "keeping its last known layout" in r.getMessage()]
    assert [(r.levelno, r.name) for r in kept] == [(logging.WARNING, "router.fleet.health")]
