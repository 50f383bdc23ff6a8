"""Background health probing: ``GET /health`` per worker, then the prefill's bootstrap layout.

A worker is routable once a probe succeeded (and, for vllm-mooncake, its engine ids are known).
It stops being routable when a probe fails or after N consecutive failed requests, and comes back
with the next successful probe. Every probe re-reads the prefill's layout, so a restarted prefill
(new engine ids) is picked up within one interval; ``refresh_soon`` does it at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from registry.engine_api import RankTables
from router.interrupt import reap
from router.rank_layout import RankLayoutUnavailable, fetch_rank_layout, namespace_rank_layout
from router.settings import EngineProtocol, HealthSettings
from router.upstream_httpx import NODELAY
from router.workers import Role, Worker, WorkerPool

__all__ = ["HealthProber"]

logger = logging.getLogger(__name__)


class HealthProber:
    """Owns the probe client and the probe loop; run ``run()`` as a lifespan task."""

    def __init__(
        self,
        pool: WorkerPool[Any],
        engine: EngineProtocol,
        settings: HealthSettings,
        tables: RankTables | None = None,
    ) -> None:
        self._pool = pool
        self._tables = tables
        self._engine = engine
        self._settings = settings
        self._client = httpx.AsyncClient(
            timeout=settings.timeout_s,
            transport=httpx.AsyncHTTPTransport(socket_options=NODELAY, retries=0),
        )
        self._refreshing: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Probe every worker now and then every ``interval_s`` until cancelled."""
        while True:
            await self.probe_all()
            await asyncio.sleep(self._settings.interval_s)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(worker) for worker in self._pool.all()))

    async def probe(self, worker: Worker) -> None:
        healthy = await self._alive(worker)
        if healthy and worker.role is Role.PREFILL:
            healthy = await self._learn_layout(worker)
        if healthy != worker.healthy:
            logger.info(
                "%s worker %s is now %s",
                worker.role.value,
                worker.url,
                "healthy" if healthy else "unhealthy",
            )
        worker.healthy = healthy
        if healthy:
            worker.consecutive_failures = 0

    def refresh_soon(self, worker: Worker) -> None:
        """Re-read ``worker``'s layout now (deduplicated); used when a decode reports it stale."""
        if worker.id in self._refreshing:
            return
        task = asyncio.create_task(self.probe(worker))
        self._refreshing[worker.id] = task
        task.add_done_callback(lambda _: self._refreshing.pop(worker.id, None))

    async def aclose(self) -> None:
        """Cancel the refresh probes, wait until they ended, then close their HTTP client."""
        await asyncio.gather(*(reap(task) for task in list(self._refreshing.values())))
        await self._client.aclose()

    async def _alive(self, worker: Worker) -> bool:
        try:
            response = await self._client.get(worker.url + "/health")
        except httpx.HTTPError as exc:
            logger.debug("health probe of %s failed: %r", worker.url, exc)
            return False
        return response.status_code == 200

    async def _learn_layout(self, worker: Worker) -> bool:
        try:
            if worker.bootstrap_namespace is not None and self._tables is not None:
                layout = await namespace_rank_layout(
                    self._tables, self._engine, worker.bootstrap_namespace
                )
            else:
                layout = await fetch_rank_layout(self._client, self._engine, worker)
        except RankLayoutUnavailable as exc:
            if worker.healthy or worker.engine_ids:
                logger.warning("prefill %s layout unavailable: %s", worker.url, exc)
            worker.set_layout(worker.dp_size, ())
            return False
        if layout.engine_ids != worker.engine_ids or layout.dp_size != worker.dp_size:
            logger.info(
                "prefill %s layout: dp_size=%d engine_ids=%s",
                worker.url,
                layout.dp_size,
                list(layout.engine_ids),
            )
        worker.set_layout(layout.dp_size, layout.engine_ids)
        return True
