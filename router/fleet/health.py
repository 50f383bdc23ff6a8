"""Background health probing: ``GET /health`` per worker, then the prefill's bootstrap layout.

A worker is healthy once a probe succeeded (and, for vllm-mooncake, its engine ids are known).
It is marked down after ``unhealthy_threshold`` failed probes in a row (a stall of the router or
the host fails one round of probes, which takes nobody out), at once when its port refuses
connections, and never by a failed probe while it served a request within the last interval; a
fallen worker comes back after ``healthy_threshold`` good probes (one ejected by outlier
detection, ``router.fleet.outlier``, not before its ejection time). Failed requests are the circuit
breakers' business (router.fleet.circuit_breaker): routing needs both a healthy worker and a breaker
that lets the request through. Every probe re-reads the prefill's layout from its bootstrap
server, so a restarted prefill (new engine ids) is picked up within one interval;
``refresh_soon`` does it at once. A prefill that registers with this router's registry has its
layout re-read when a watch of the registry's store saw its namespace's rank keys change since
the last read (``registry.engine_api.LayoutChanges``), and on every probe while that watch is
not running or the prefill is not healthy: with a store over the network (etcd, or ``--workers
N``'s supervisor) a read is two round trips per prefill per probe. A worker
that joins or comes back, and declares no models, has its ``/v1/models`` read (the model pools,
``router.scheduling.model_pools``), with ``--engine-api-key`` as its ``Authorization`` (engines
behind ``--api-key`` refuse the read without).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import msgspec

from registry.backends.base import RegistryStore
from registry.engine_api import LayoutChanges, LayoutMark, RankTables
from router.errors import UpstreamError
from router.fleet.probe_client import ProbeAnswer, ProbeClient
from router.fleet.rank_layout import (
    RankLayoutUnavailable,
    RegistryDown,
    fetch_rank_layout,
    namespace_rank_layout,
)
from router.interrupt import reap
from router.settings import ClientAuthSettings, EngineProtocol, HealthSettings
from router.workers import Role, Worker, WorkerPool

__all__ = ["HealthProber", "connection_refused"]

logger = logging.getLogger(__name__)


class _Probe(Enum):
    OK = "ok"
    FAILED = "failed"  # timeout, error status, bad layout: maybe just busy
    REFUSED = "refused"  # nothing listens on the port: the engine is gone


class HealthProber:
    """Owns the probe client and the probe loop; run ``run()`` as a lifespan task.
    ``auth``: its ``engine_api_key`` (the engines' ``--api-key``) goes on the ``/v1/models``
    reads."""

    def __init__(
        self,
        pool: WorkerPool[Any],
        engine: EngineProtocol,
        settings: HealthSettings,
        tables: RankTables | None = None,
        store: RegistryStore | None = None,
        auth: ClientAuthSettings | None = None,
    ) -> None:
        self._pool = pool
        key = None if auth is None else auth.engine_api_key
        secret = None if key is None else key.get_secret_value()
        self._engine_authorization = f"Bearer {secret}" if secret else None
        self._tables = tables
        # the namespaces' layout changes, when ``tables`` are over ``store`` (None: read always)
        self._layout_changes = _layout_changes(engine, store) if tables is not None else None
        self._layout_marks: dict[str, LayoutMark] = {}  # worker id -> its last layout read's
        self._engine = engine
        self._settings = settings
        self._client = ProbeClient(settings.timeout_s)
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        # told when a worker marked down comes back up (the circuit breakers forget it)
        self.on_back: Callable[[Worker], None] | None = None
        # told whenever a worker goes up or down (router.fleet.host_probes: the leader tells
        # its siblings at once, not at its next interval)
        self.on_verdict: Callable[[], None] | None = None
        self._kept_layouts: set[str] = set()  # prefills kept on their last layout: registry down
        self.rounds = 0  # rounds over every worker done (router.fleet.host_probes waits for one)

    async def run(self) -> None:
        """Probe every worker now and then every ``interval_s`` until cancelled."""
        while True:
            await self.probe_all()
            await asyncio.sleep(self._settings.interval_s)

    async def probe_all(self) -> None:
        workers = self._pool.all()
        await asyncio.gather(*(self.probe(worker) for worker in workers))
        ids = {worker.id for worker in workers}
        await self._client.prune(ids)
        if len(self._layout_marks) > len(workers):  # some left the pool
            self._layout_marks = {k: m for k, m in self._layout_marks.items() if k in ids}
        self.rounds += 1
        if self.rounds == 1 and self.on_verdict is not None:
            self.on_verdict()  # the first verdicts are known: told now, not an interval later

    async def probe(self, worker: Worker) -> None:
        started = time.monotonic()
        outcome = await self._alive(worker)
        if outcome is _Probe.OK and worker.role is Role.PREFILL:
            outcome = await self._learn_layout(worker)
        if outcome is _Probe.OK and not worker.healthy and not worker.models_declared:
            await self._learn_models(worker)  # it joins or comes back: what does it serve now?
        if outcome is _Probe.OK:
            self._probe_succeeded(worker)
        else:
            self._probe_failed(worker, outcome, started)

    def _probe_succeeded(self, worker: Worker) -> None:
        worker.probe_failures = 0
        worker.probe_successes += 1
        if worker.healthy:
            return
        needed = self._settings.healthy_threshold if worker.seen_healthy else 1
        if worker.ejected and time.monotonic() < worker.ejected_until:
            return  # ejected by outlier detection: out for its ejection time at least
        if worker.probe_successes >= needed:
            reason = (
                f"{worker.probe_successes} probes in a row succeeded"
                if worker.seen_healthy
                else "its first probe succeeded"
            )
            logger.info(
                "%s worker %s is now healthy: %s", worker.role.value, worker.public_url, reason
            )
            worker.mark_up()
            if self.on_back is not None:
                self.on_back(worker)
            if self.on_verdict is not None:
                self.on_verdict()

    def _probe_failed(self, worker: Worker, outcome: _Probe, started: float) -> None:
        worker.probe_successes = 0
        if not worker.healthy:
            return
        if outcome is _Probe.FAILED and worker.last_success >= started - self._settings.interval_s:
            logger.debug(
                "probe of %s failed, but it is serving requests: ignored", worker.public_url
            )
            return
        worker.probe_failures += 1
        threshold = self._settings.unhealthy_threshold
        if outcome is _Probe.REFUSED or worker.probe_failures >= threshold:
            reason = (
                "its port refuses connections"
                if outcome is _Probe.REFUSED
                else f"{worker.probe_failures} probes in a row failed"
            )
            logger.warning(
                "%s worker %s is now unhealthy: %s", worker.role.value, worker.public_url, reason
            )
            worker.mark_down(reason)
            if worker.role is Role.PREFILL:
                worker.set_layout(worker.dp_size, ())
                self._layout_marks.pop(worker.id, None)
            if self.on_verdict is not None:
                self.on_verdict()

    def refresh_soon(self, worker: Worker) -> None:
        """Re-read ``worker``'s layout now (deduplicated); used when a decode reports it stale."""
        if worker.id in self._refreshing:
            return
        self._layout_marks.pop(worker.id, None)  # read it whatever the registry's watch says
        task = asyncio.create_task(self.probe(worker))
        self._refreshing[worker.id] = task
        task.add_done_callback(lambda _: self._refreshing.pop(worker.id, None))

    async def aclose(self) -> None:
        """Cancel the refresh probes and the layout watches, wait until they ended, then close
        their HTTP client."""
        await asyncio.gather(*(reap(task) for task in list(self._refreshing.values())))
        if self._layout_changes is not None:
            await self._layout_changes.aclose()
        await self._client.aclose()

    async def _alive(self, worker: Worker) -> _Probe:
        try:
            response = await self._client.get(worker, "/health")
        except UpstreamError as exc:
            logger.debug("health probe of %s failed: %r", worker.public_url, exc)
            return _Probe.REFUSED if connection_refused(exc) else _Probe.FAILED
        if response.status != 200:
            logger.debug("health probe of %s: HTTP %d", worker.public_url, response.status)
            return _Probe.FAILED
        return _Probe.OK

    async def read_models(
        self, worker: Worker, authorization: str | None = None
    ) -> list[dict[str, Any]]:
        """The entries of ``worker``'s ``/v1/models`` (OpenAI's list; none for an error status
        or another body), read with ``authorization`` (None: ``--engine-api-key``'s, if any).
        Raises UpstreamError."""
        authorization = authorization or self._engine_authorization
        headers = {} if authorization is None else {"authorization": authorization}
        return _model_entries(await self._client.get(worker, "/v1/models", headers))

    async def _learn_models(self, worker: Worker) -> None:
        """The model names in the worker's ``/v1/models`` (OpenAI's list) and which are LoRA
        adapters (an entry with a ``parent``: vLLM's and SGLang's adapter cards); on any failure
        the names it had stay (none: a candidate for every model)."""
        try:
            entries = await self.read_models(worker)
        except UpstreamError as exc:
            logger.debug("reading the models of %s failed: %r", worker.public_url, exc)
            return
        names = frozenset(entry["id"] for entry in entries if entry["id"])
        adapters = frozenset(
            entry["id"] for entry in entries if entry["id"] and entry.get("parent")
        )
        if names and (names, adapters) != (worker.models, worker.adapters):
            logger.info(
                "%s worker %s serves %s", worker.role.value, worker.public_url, sorted(names)
            )
            self._pool.set_models(worker, names, declared=False, adapters=adapters)

    async def _learn_layout(self, worker: Worker) -> _Probe:
        namespace, mark = worker.bootstrap_namespace, None
        try:
            if namespace is not None and self._tables is not None:
                if self._layout_unchanged(worker, namespace):
                    return _Probe.OK
                mark = self._mark_layout(worker, namespace)
                layout = await namespace_rank_layout(self._tables, self._engine, namespace)
            else:
                layout = await fetch_rank_layout(self._client, self._engine, worker)
        except RegistryDown as exc:
            return self._keep_layout(worker, exc)
        except RankLayoutUnavailable as exc:
            if worker.healthy or worker.engine_ids:
                logger.warning("prefill %s layout unavailable: %s", worker.public_url, exc)
            return _Probe.FAILED
        if worker.id in self._kept_layouts:
            self._kept_layouts.discard(worker.id)
            logger.info("prefill %s layout readable again", worker.public_url)
        if layout.engine_ids != worker.engine_ids or layout.dp_size != worker.dp_size:
            logger.info(
                "prefill %s layout: dp_size=%d engine_ids=%s",
                worker.public_url,
                layout.dp_size,
                list(layout.engine_ids),
            )
        worker.set_layout(layout.dp_size, layout.engine_ids)
        if mark is not None:
            self._layout_marks[worker.id] = mark
        return _Probe.OK

    def _layout_unchanged(self, worker: Worker, namespace: str) -> bool:
        """Whether a healthy prefill's layout, read before, is unchanged in the registry."""
        mark = self._layout_marks.get(worker.id)
        changes = self._layout_changes
        return (
            mark is not None
            and changes is not None
            and worker.healthy
            and changes.unchanged(namespace, mark)
        )

    def _mark_layout(self, worker: Worker, namespace: str) -> LayoutMark | None:
        """Before a read: forget the last one's mark; the namespace's mark now (None while
        the registry's watches of it are not running; the first asks starts them)."""
        self._layout_marks.pop(worker.id, None)
        changes = self._layout_changes
        return None if changes is None else changes.mark(namespace)

    def _keep_layout(self, worker: Worker, exc: RegistryDown) -> _Probe:
        """The registry is down, which says nothing about the prefill: keep its last known
        layout (OK) when it has one; warn once per outage."""
        known = worker.seen_healthy and (
            worker.engine_ids or self._engine is not EngineProtocol.VLLM_MOONCAKE
        )
        if not known:
            return _Probe.FAILED
        if worker.id not in self._kept_layouts:
            self._kept_layouts.add(worker.id)
            logger.warning(
                "prefill %s: keeping its last known layout (dp_size=%d) while the registry is "
                "unavailable: %s",
                worker.public_url,
                worker.dp_size,
                exc,
            )
        return _Probe.OK


def _model_entries(response: ProbeAnswer) -> list[dict[str, Any]]:
    """The entries with a string ``id`` of an OpenAI model list answered with 200 (else none)."""
    if response.status != 200:  # 401: the engine wants a key (--engine-api-key)
        return []
    try:
        entries = msgspec.json.decode(response.body).get("data")
    except (ValueError, AttributeError):
        return []
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]


def _layout_changes(engine: EngineProtocol, store: RegistryStore | None) -> LayoutChanges | None:
    if store is None:
        return None
    if engine is EngineProtocol.SGLANG:
        return LayoutChanges.of_sglang(store)
    if engine is EngineProtocol.VLLM_MOONCAKE:
        return LayoutChanges.of_vllm(store)
    return None  # vLLM NIXL: nothing to read


def connection_refused(exc: BaseException) -> bool:
    """Whether a connect failed because nothing listens (not a connect timeout): a refused
    connection somewhere in ``exc``'s causes, or its message says so."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return True
        cause = cause.__cause__ or cause.__context__
    return "refused" in str(exc).lower()
