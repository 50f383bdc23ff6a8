"""Keeps the router's worker pool equal to its CLI workers plus the registry's workers.

CLI workers are written to the registry at start-up (source "static") and also added locally,
so the router serves them even when the store is unreachable. They belong to this router
whatever the store says: a listing or a delete never removes them, and when the store lost
their records (an empty or wiped etcd) they are written again. Then: list, reconcile, watch, and
re-list every ``resync_s`` (or after a failure); while the store is down the pool keeps its last
known set and ``status`` says so. A listing that suddenly lacks the discovered workers is judged
by ``store_trust`` first: a suspect one (the store came back empty, lost most workers at once,
or lost this router's own records) keeps the last good set for up to the grace, and ``status``
says so (``ok`` false, ``suspect_since``). A worker deleted in the watch leaves after a short
settle and a re-list, so deletes that arrive together (a wiped prefix) are judged as one batch.
A worker marked draining gets no new requests; once this router has none in flight on it, it
deletes the record (a draining CLI worker then stays out of service, unregistered). A removed
worker keeps its client until its in-flight requests are done.

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
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from registry.errors import RegistryError, RegistryUnavailable
from registry.models import WorkerRecord, check_worker_url, redact_url, worker_id
from registry.service import RegistryService, WorkerChange
from router.fleet.health import HealthProber
from router.fleet.store_trust import RemovalBatch, StoreTrust
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
    """Whether the store is reachable and believed, as ``/ready`` and the metrics show it."""

    url: str
    ok: bool = False
    error: str | None = None
    since: float = 0.0  # time.time() of the last change of ``ok``
    suspect_since: float | None = None  # time.time() since the store is suspect (not believed)

    def mark_suspect(self, error: str) -> None:
        """The store answers but is not believed (``store_trust``)."""
        if self.suspect_since is None:
            self.suspect_since = time.time()
            self.since = self.suspect_since
        self.ok, self.error = False, error

    def mark(self, ok: bool, error: str | None) -> None:
        """Reachable and in sync (``ok``), or not and why; logs the changes."""
        if ok and self.suspect_since is not None:
            self.suspect_since = None
            self.ok = False  # logged by store_trust; the line below says it is in sync
        if ok != self.ok:
            if ok:
                logger.info(
                    "registry %s is reachable; worker set synchronised", redact_url(self.url)
                )
            else:
                logger.warning(
                    "registry %s unreachable, serving the last known workers: %s",
                    redact_url(self.url),
                    error,
                )
            self.since = time.time()
        self.ok, self.error = ok, error


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
        self._static: dict[str, WorkerRecord] = {}  # the CLI workers' records, by id
        registry = settings.registry
        self._trust = StoreTrust(registry.suspect_grace_s, registry.suspect_removed_share)
        self.status = RegistryStatus(url=registry.url)

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
                models=spec.models,
            )
            for spec in self._settings.prefill
        ]
        static += [
            WorkerRecord(
                id=worker_id("decode", spec.url),
                role="decode",
                url=spec.url,
                source="static",
                models=spec.models,
            )
            for spec in self._settings.decode
        ]
        self._static = {record.id: record for record in static}
        for record in static:
            self._apply(record.id, record)
        try:
            await register_own(self._service, static)
        except RegistryUnavailable as exc:
            self.status.mark(False, str(exc))

    async def _restore_own(self, records: list[WorkerRecord]) -> None:
        """Best effort: the next listing tries again."""
        logger.warning(
            "registry: %d of this router's own worker records are missing from the store; "
            "registering them again",
            len(records),
        )
        with contextlib.suppress(RegistryError):
            await register_own(self._service, records)

    async def run(self) -> None:
        """Sync forever: list + watch, re-list periodically and after failures."""
        while True:
            try:
                await self._sync()
            except RegistryUnavailable as exc:
                self.status.mark(False, str(exc))
                await asyncio.sleep(self._settings.registry.resync_backoff_s)
            except Exception as exc:  # noqa: BLE001 - discovery must outlive any one failure
                logger.exception("registry sync failed; retrying")
                self.status.mark(False, f"sync failed: {exc!r}")
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
            after_outage = not self.status.ok and self.status.suspect_since is None
            records = {r.id: r for r in await self._service.list_workers()}
            self._reconcile(records, after_outage)
            for wid in [wid for wid in self._skipped if wid not in records]:
                del self._skipped[wid]
            for wid, record in records.items():
                self._apply_one(wid, record)
            await self._follow(changes)

    def _reconcile(self, records: dict[str, WorkerRecord], after_outage: bool) -> None:
        """Remove the workers ``records`` lacks, unless the store is suspect (``store_trust``)."""
        lost = [
            r
            for wid, r in self._static.items()
            if wid not in records and not self._is_draining(wid)
        ]
        if lost:
            self._spawn(self._restore_own(lost))
        leaving = [w for w in self._pool.all() if w.id not in records and w.id not in self._static]
        live = [w for w in self._pool.all() if w.id not in self._static and not w.draining]
        batch = RemovalBatch(
            leaving=sum(1 for w in leaving if not w.draining),
            live=len(live),
            after_outage=after_outage,
            own_records_lost=bool(lost),
        )
        if self._trust.hold(batch):
            self.status.mark_suspect(
                f"suspect store: {self._trust.reason}; keeping the last good workers"
            )
            return
        for worker in leaving:
            self._apply_one(worker.id, None)
        self.status.mark(True, None)

    async def _follow(self, changes: AsyncIterator[WorkerChange]) -> None:
        """Apply watched changes until the next re-list (sooner while the store is suspect, and
        after any change then); a delete of a worker in service ends the watch, after a settle,
        so that the re-list judges it with the deletes that came with it."""
        remaining = self._trust.remaining_s()
        wait_s = self._resync_s if remaining is None else min(self._resync_s, remaining + 0.01)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                async for change in changes:
                    if change.record is None and self._in_service(change.worker_id):
                        await asyncio.sleep(self._settings.registry.removal_settle_s)
                        return
                    self._apply_one(change.worker_id, change.record)
                    if self._trust.suspect_since is not None:
                        return  # a worker shows up again: re-list and judge the store again

    def _in_service(self, wid: str) -> bool:
        worker = self._pool.get(wid)
        return worker is not None and (wid in self._static or not worker.draining)

    def _is_draining(self, wid: str) -> bool:
        worker = self._pool.get(wid)
        return worker is not None and worker.draining

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
            if worker is not None and wid not in self._static:  # CLI workers are ours
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
        place_bootstrap(worker, record.bootstrap_namespace, self._settings)
        worker.models, worker.models_declared = frozenset(record.models), bool(record.models)
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
        if record.models or worker.models_declared:  # declared now, or no longer
            self._pool.set_models(worker, frozenset(record.models), declared=bool(record.models))
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
            place_bootstrap(worker, record.bootstrap_namespace, self._settings)
            worker.set_layout(worker.dp_size, ())
            self._prober.refresh_soon(worker)

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


async def register_own(service: RegistryService, records: list[WorkerRecord]) -> None:
    """Write this router's CLI workers to the store (idempotent)."""
    for record in records:
        await service.add_worker(
            record.role,
            record.url,
            bootstrap_port=record.bootstrap_port,
            bootstrap_namespace=record.bootstrap_namespace,
            source="static",
            kv_events=record.kv_events,
            kv_events_replay=record.kv_events_replay,
        )


def place_bootstrap(worker: Worker, namespace: str | None, settings: RouterSettings) -> None:
    """A prefill registering with this router: decoders bootstrap from the router."""
    worker.bootstrap_namespace = namespace
    if namespace is None:
        return
    registry = settings.registry
    listen = registry.bootstrap_host or settings.server.host
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
