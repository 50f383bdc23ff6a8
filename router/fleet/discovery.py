"""Keeps the router's worker pool equal to its CLI workers plus the registry's workers.

CLI workers are written to the registry at start-up (source "static") and also added locally,
so the router serves them even when the store is unreachable. Then: list, reconcile, watch, and
re-list every ``resync_s`` (or after a failure); while the store is down the pool keeps its last
known set and ``status`` says so. A worker marked draining gets no new requests; once this router
has none in flight on it, it deletes the record. A removed worker keeps its client until its
in-flight requests are done.

One bad record (an unusable URL written by an older version or straight into the store) is
logged once, naming its id and why, and skipped: it never stops discovery, so workers added
later still join and removed ones still leave. An unexpected failure of a whole sync is logged
and retried like an unreachable store. Worker URLs are logged without their credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from registry.errors import RegistryError, RegistryUnavailable
from registry.models import WorkerRecord, check_worker_url, redact_url, worker_id
from registry.service import RegistryService
from router.fleet.health import HealthProber
from router.settings import RouterSettings
from router.upstream import build_upstream
from router.upstream.base import UpstreamClient, UpstreamPool
from router.workers import Role, Worker, format_host

__all__ = ["Discovery", "RegistryStatus"]

logger = logging.getLogger(__name__)
_IDLE_POLL_S = 0.05


def _advertised(listen_host: str) -> str:
    if listen_host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return listen_host


@dataclass(slots=True)
class RegistryStatus:
    url: str
    ok: bool = False
    error: str | None = None
    since: float = 0.0  # time.time() of the last change of ``ok``


class Discovery:
    """Owns pool membership; run ``run()`` as a lifespan task after ``seed()``."""

    def __init__(
        self,
        pool: UpstreamPool,
        service: RegistryService,
        settings: RouterSettings,
        prober: HealthProber,
        *,
        resync_s: float = 10.0,
    ) -> None:
        self._pool = pool
        self._service = service
        self._settings = settings
        self._prober = prober
        self._resync_s = resync_s
        self._closing: set[asyncio.Task[None]] = set()
        self._skipped: dict[str, str] = {}  # worker id -> why its record was skipped (logged)
        self.status = RegistryStatus(url=settings.registry.url)

    async def seed(self) -> None:
        """Add the CLI workers locally, then (best effort) to the registry."""
        static = [
            WorkerRecord(
                id=worker_id("prefill", spec.url),
                role="prefill",
                url=spec.url,
                bootstrap_port=spec.bootstrap_port,
                bootstrap_namespace=spec.bootstrap_namespace,
                source="static",
                kv_events=spec.kv_events,
                kv_events_replay=spec.kv_events_replay,
            )
            for spec in self._settings.prefill
        ]
        static += [
            WorkerRecord(
                id=worker_id("decode", spec.url), role="decode", url=spec.url, source="static"
            )
            for spec in self._settings.decode
        ]
        for record in static:
            self._apply(record.id, record)
        try:
            for record in static:
                await self._service.add_worker(
                    record.role,
                    record.url,
                    bootstrap_port=record.bootstrap_port,
                    bootstrap_namespace=record.bootstrap_namespace,
                    source="static",
                    kv_events=record.kv_events,
                    kv_events_replay=record.kv_events_replay,
                )
        except RegistryUnavailable as exc:
            self._set_status(False, str(exc))

    async def run(self) -> None:
        """Sync forever: list + watch, re-list periodically and after failures."""
        while True:
            try:
                await self._sync()
            except RegistryUnavailable as exc:
                self._set_status(False, str(exc))
                await asyncio.sleep(self._settings.registry.resync_backoff_s)
            except Exception as exc:  # noqa: BLE001 - discovery must outlive any one failure
                logger.exception("registry sync failed; retrying")
                self._set_status(False, f"sync failed: {exc!r}")
                await asyncio.sleep(self._settings.registry.resync_backoff_s)

    async def aclose(self) -> None:
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(client.aclose() for client in self._pool.clients()))

    async def _sync(self) -> None:
        # Watch first, then list: changes made while listing are replayed afterwards, in order,
        # which ends in the same state as the store.
        changes = self._service.watch_workers()
        async with contextlib.aclosing(changes):
            records = {r.id: r for r in await self._service.list_workers()}
            for wid in [w.id for w in self._pool.all() if w.id not in records]:
                self._apply_one(wid, None)
            for wid in [wid for wid in self._skipped if wid not in records]:
                del self._skipped[wid]
            for wid, record in records.items():
                self._apply_one(wid, record)
            self._set_status(True, None)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._resync_s):
                    async for change in changes:
                        self._apply_one(change.worker_id, change.record)

    def _apply_one(self, wid: str, record: WorkerRecord | None) -> None:
        """Apply one record; a record that cannot become a worker is logged (once) and skipped."""
        try:
            self._apply(wid, record)
        except Exception as exc:  # noqa: BLE001 - one bad record must never stop discovery
            reason = str(exc) or repr(exc)
            if self._skipped.get(wid) != reason:
                logger.warning("registry: skipping worker record %s: %s", wid, reason)
            self._skipped[wid] = reason
        else:
            self._skipped.pop(wid, None)

    def _apply(self, wid: str, record: WorkerRecord | None) -> None:
        worker = self._pool.get(wid)
        if record is None:
            if worker is not None:
                self._remove(wid)
        elif worker is None:
            self._add(record)
        else:
            self._update(worker, record)

    def _add(self, record: WorkerRecord) -> None:
        """Raises ValueError (naming why) for a record that cannot be a worker."""
        worker = Worker(
            Role(record.role),
            check_worker_url(record.url),
            record.bootstrap_port,
            id=record.id,
            epoch=record.epoch,
            draining=record.draining,
            kv_events=record.kv_events,
            kv_events_replay=record.kv_events_replay,
        )
        self._place_bootstrap(worker, record.bootstrap_namespace)
        self._pool.add(worker, build_upstream(worker, self._settings.upstream))
        logger.info(
            "worker %s %s joined (source %s)",
            worker.role.value,
            redact_url(worker.url),
            record.source,
        )
        self._prober.refresh_soon(worker)

    def _update(self, worker: Worker, record: WorkerRecord) -> None:
        if record.draining and not worker.draining:
            logger.info("worker %s %s is draining", worker.role.value, redact_url(worker.url))
            self._spawn(self._finish_drain(worker))
        worker.draining = record.draining
        # the KV event feed notices a changed endpoint and re-subscribes
        worker.kv_events, worker.kv_events_replay = record.kv_events, record.kv_events_replay
        if record.epoch != worker.epoch:
            logger.info(
                "worker %s %s re-registered (epoch %d): dropping its cached layout",
                worker.role.value,
                redact_url(worker.url),
                record.epoch,
            )
            worker.epoch, worker.bootstrap_port = record.epoch, record.bootstrap_port
            worker.bootstrap_host, worker.bootstrap_path = worker.host, ""
            self._place_bootstrap(worker, record.bootstrap_namespace)
            worker.set_layout(worker.dp_size, ())
            self._prober.refresh_soon(worker)

    def _place_bootstrap(self, worker: Worker, namespace: str | None) -> None:
        """A prefill registering with this router: decoders bootstrap from the router."""
        worker.bootstrap_namespace = namespace
        if namespace is None:
            return
        registry = self._settings.registry
        listen = registry.bootstrap_host or self._settings.server.host
        worker.bootstrap_host = format_host(registry.advertise_host or _advertised(listen))
        port = registry.bootstrap_ports.get(namespace)
        if port is not None:
            worker.bootstrap_port = port
        elif registry.bootstrap_port is not None:
            # vLLM decoders accept a path prefix; SGLang ones need a namespace port
            worker.bootstrap_port = registry.bootstrap_port
            worker.bootstrap_path = f"/bootstrap/{namespace}"
        else:
            logger.warning(
                "prefill %s registers under bootstrap namespace %r, but this router serves "
                "neither a port for it (--bootstrap-namespace %s=PORT) nor a shared "
                "--bootstrap-port: decoders cannot reach its ranks",
                worker.public_url,
                namespace,
                namespace,
            )

    def _remove(self, wid: str) -> None:
        removed = self._pool.remove(wid)
        if removed is not None:
            worker, client = removed
            logger.info(
                "worker %s %s left; %d request(s) still in flight",
                worker.role.value,
                redact_url(worker.url),
                worker.inflight,
            )
            self._spawn(self._close_when_idle(worker, client))

    async def _close_when_idle(self, worker: Worker, client: UpstreamClient) -> None:
        await self._wait_idle(worker)
        await client.aclose()

    async def _finish_drain(self, worker: Worker) -> None:
        await self._wait_idle(worker)
        with contextlib.suppress(RegistryError):  # gone already, or the store is down: next sync
            await self._service.remove_worker(worker.id)

    async def _wait_idle(self, worker: Worker) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._settings.registry.drain_timeout_s):
                while worker.inflight:  # noqa: ASYNC110 - an Event would tax every request
                    await asyncio.sleep(_IDLE_POLL_S)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _set_status(self, ok: bool, error: str | None) -> None:
        if ok != self.status.ok:
            if ok:
                logger.info(
                    "registry %s is reachable; worker set synchronised", redact_url(self.status.url)
                )
            else:
                logger.warning(
                    "registry %s unreachable, serving the last known workers: %s",
                    redact_url(self.status.url),
                    error,
                )
            self.status.since = time.time()
        self.status.ok, self.status.error = ok, error
