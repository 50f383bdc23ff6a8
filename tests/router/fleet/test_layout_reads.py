"""The health prober reads a registered prefill's rank layout from the registry only when the
registry's watch saw it change (issue 23: with ``--workers N`` every read was two HTTP round trips
to the supervisor's store per prefill per probe, most of the processes' idle CPU). A registry
over HTTP as ``--workers N`` has it (``registry serve``'s ``/store``), a real ``/health`` port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from registry.app import create_registry_app
from registry.backends import HttpStore
from registry.engine_api import RankTables, VllmRankTable
from registry.engine_api.vllm_payloads import RegisterWorkerPayload
from registry.settings import RegistrySettings
from router.fleet.health import HealthProber
from router.settings import EngineProtocol, HealthSettings
from router.workers import Role, Worker, WorkerPool
from testkit.polling import await_until
from testkit.servers import run_server


class _CountedStore(HttpStore):
    """The registry's store over HTTP, counting the reads."""

    reads = 0

    async def get(self, key: str) -> bytes | None:
        self.reads += 1
        return await super().get(key)

    async def list(self, prefix: str) -> dict[str, bytes]:
        self.reads += 1
        return await super().list(prefix)


@pytest.fixture
def registry_url() -> Iterator[str]:
    with run_server(create_registry_app(RegistrySettings())) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
async def store(registry_url: str) -> AsyncIterator[_CountedStore]:
    opened = _CountedStore(registry_url)
    yield opened
    await opened.close()


async def _register(store: HttpStore, engine_id: str) -> None:
    payload = RegisterWorkerPayload(
        engine_id=engine_id, dp_rank=0, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:40000"
    )
    await VllmRankTable(store, "p1").register(payload)


async def test_a_prefills_layout_is_read_again_only_when_the_registry_changed(
    alive_url: str, store: _CountedStore
) -> None:
    await _register(store, "e0")
    tables = RankTables()
    tables.bind(store)
    prefill = Worker(Role.PREFILL, alive_url, id="p1", bootstrap_namespace="p1")
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=True)
    pool.add(prefill, None)
    settings = HealthSettings(unhealthy_threshold=1, healthy_threshold=1)
    prober = HealthProber(pool, EngineProtocol.VLLM_MOONCAKE, settings, tables, store)
    try:
        await prober.probe_all()  # the first read; the registry's watch starts
        assert prefill.healthy and prefill.engine_ids == ("e0",)
        await prober.probe_all()  # read again, now with the watch running
        reads = store.reads
        for _ in range(5):
            await prober.probe_all()
        assert store.reads == reads  # nothing changed: no read

        await _register(store, "e1")  # the prefill restarted: a new engine id, a new epoch

        for _ in range(100):  # the watch tells within milliseconds; a probe round each 10 ms
            await prober.probe_all()
            if prefill.engine_ids == ("e1",):
                break
            await asyncio.sleep(0.01)
        assert prefill.engine_ids == ("e1",)
        reads = store.reads
        prober.refresh_soon(prefill)  # a decode reported it stale: read whatever the watch says
        await await_until(lambda: store.reads > reads, 5.0, "the refresh's read")
    finally:
        await prober.aclose()
