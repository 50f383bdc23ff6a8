"""Keeps the registry's ``kubernetes`` workers equal to the Ready pods of each role's selector.

Per role: list the pods (paged), reconcile, then watch from the list's resourceVersion with
``allowWatchBookmarks`` (a BOOKMARK only advances the resourceVersion) and a server-side
timeout; when the server ends a watch, watch again from where it stopped, without listing. A
Ready pod becomes a worker through ``RegistryService.add_worker(..., source="kubernetes")``
(idempotent; re-adding clears draining); a pod that stops being Ready, starts terminating, is
deleted, or gets a bad annotation has its worker drained (``Discovery`` removes a drained record
once this router has nothing in flight on it). Pod uid -> worker id is remembered, so a deleted
pod drains the worker it produced whatever its final state says.

A watch that expired (410 Gone: the HTTP status of the watch request, or an ``ERROR`` event
whose Status code is 410) is followed by a fresh list that reconciles: pods gone meanwhile are
drained. Any other failure (the API server unreachable or restarting, an error status, the
registry unavailable) is logged, shown in ``status``, and retried after a back-off (doubling
from ``backoff_s`` to ``max_backoff_s``) with a fresh list. Each list also drains the
``kubernetes`` records of its role that no Ready pod stands for (left over from before a
restart, when the registry is shared and persistent): routers sharing a registry must therefore
watch the same pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, ApiException, CoreV1Api, V1Pod
from kubernetes_asyncio.watch import Watch

from registry.errors import NotFound, RegistryError
from registry.models import redact_url, worker_id
from registry.service import RegistryService
from router.fleet.kube.client_config import cluster_access
from router.fleet.kube.pod_workers import PodSkipped, PodWorker, Role, pod_name, worker_from_pod
from router.settings import KubernetesDiscoverySettings

__all__ = ["PodWatchStatus", "PodWatcher", "open_pod_watcher"]

logger = logging.getLogger(__name__)

_MAX_LIST_PAGES = 100_000
# what a watch or list may fail with, short of a bug: logged without a traceback
_EXPECTED = (ApiException, aiohttp.ClientError, OSError, TimeoutError, RegistryError)


class WatchProtocolError(RuntimeError):
    """The watch stream carried something that is not a watch event."""


@dataclass(slots=True)
class PodWatchStatus:
    """Whether every role's pods are listed and followed now (``error``: why not)."""

    namespace: str
    ok: bool = False
    error: str | None = None
    since: float = 0.0  # time.time() of the last change of ``ok``

    def as_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "ok": self.ok, "error": self.error}


@dataclass(slots=True)
class _Tracked:
    """A pod whose worker this watcher has in the registry (not draining)."""

    worker_id: str
    pod: str
    worker: PodWorker


@dataclass(slots=True)
class _RoleWatch:
    role: Role
    selector: str
    tracked: dict[str, _Tracked] = field(default_factory=dict)  # pod uid ->
    skipped: dict[str, str] = field(default_factory=dict)  # pod uid -> why (logged once)
    resource_version: str | None = None  # None: list before watching
    from_list: bool = False  # resource_version is the list's (no watch event since)
    synced: bool = False  # listed once
    error: str | None = None


class _Backoff:
    """Delays after consecutive failures: ``first``, doubled each time, at most ``cap``."""

    def __init__(self, first: float, cap: float) -> None:
        self._first, self._cap, self._next = first, cap, first

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self._cap)
        return delay

    def reset(self) -> None:
        self._next = self._first


async def open_pod_watcher(
    settings: KubernetesDiscoverySettings, service: RegistryService
) -> PodWatcher:
    """A watcher with its own API client; raises KubeConfigError when no config loads."""
    access = await cluster_access(settings)
    api = ApiClient(access.configuration)
    logger.info(
        "kubernetes discovery: namespace %s, prefill pods %r, decode pods %r, API server %s",
        access.namespace,
        settings.prefill_selector,
        settings.decode_selector,
        access.configuration.host,
    )
    return PodWatcher(api, access.namespace, service, settings)


class PodWatcher:
    """Run ``run()`` as a lifespan task; ``aclose()`` closes the API client afterwards."""

    def __init__(
        self,
        api: ApiClient,
        namespace: str,
        service: RegistryService,
        settings: KubernetesDiscoverySettings,
    ) -> None:
        self._api = api
        self._core = CoreV1Api(api)
        self._namespace = namespace
        self._service = service
        self._settings = settings
        selectors: list[tuple[Role, str | None]] = [
            ("prefill", settings.prefill_selector),
            ("decode", settings.decode_selector),
        ]
        self._roles = [_RoleWatch(role, selector) for role, selector in selectors if selector]
        self.status = PodWatchStatus(namespace)

    async def run(self) -> None:
        """Follow every role's pods until cancelled; never ends on a failure."""
        async with asyncio.TaskGroup() as group:
            for watch in self._roles:
                group.create_task(self._follow(watch))

    async def aclose(self) -> None:
        await self._api.close()

    async def _follow(self, watch: _RoleWatch) -> None:
        backoff = _Backoff(self._settings.backoff_s, self._settings.max_backoff_s)
        while True:
            try:
                if watch.resource_version is None:
                    await self._relist(watch)
                    backoff.reset()
                    self._set_error(watch, None)
                await self._watch(watch)
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive any one failure
                delay = self._after_failure(watch, exc, backoff)
                if delay:
                    await asyncio.sleep(delay)

    def _after_failure(self, watch: _RoleWatch, exc: Exception, backoff: _Backoff) -> float:
        """Log ``exc``, make the next round list afresh; return how long to wait first."""
        expired = isinstance(exc, ApiException) and exc.status == 410
        fresh = watch.from_list
        watch.resource_version = None
        if expired:
            logger.info(
                "%s pods %r: watch expired (410); listing again", watch.role, watch.selector
            )
            # a list whose resourceVersion is already too old: do not spin
            return backoff.next() if fresh else 0.0
        error = _describe(exc)
        if not isinstance(exc, _EXPECTED):
            logger.exception("%s pods %r: list/watch failed", watch.role, watch.selector)
        elif error != watch.error:
            logger.warning("%s pods %r: %s; retrying", watch.role, watch.selector, error)
        self._set_error(watch, error)
        return backoff.next()

    async def _relist(self, watch: _RoleWatch) -> None:
        pods, version = await self._list(watch.selector)
        seen: set[str] = set()
        for pod in pods:
            seen.add(_uid(pod))
            await self._apply(watch, "ADDED", pod)
        for uid in [uid for uid in watch.tracked if uid not in seen]:
            await self._drain(watch, uid, "pod gone")
        watch.skipped = {uid: why for uid, why in watch.skipped.items() if uid in seen}
        await self._drain_orphans(watch)
        watch.resource_version, watch.from_list, watch.synced = version, True, True

    async def _list(self, selector: str) -> tuple[list[V1Pod], str]:
        """Every pod matching ``selector`` (page by page) and the list's resourceVersion."""
        pods: list[V1Pod] = []
        token: str | None = None
        timeout = self._settings.request_timeout_s
        for _ in range(_MAX_LIST_PAGES):
            page = await self._core.list_namespaced_pod(
                self._namespace,
                label_selector=selector,
                limit=self._settings.list_page_size,
                _request_timeout=(timeout, timeout),
                **_continue_from(token),
            )
            pods.extend(page.items or ())
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                return pods, page.metadata.resource_version
        raise WatchProtocolError(f"pod list did not end after {_MAX_LIST_PAGES} pages")

    async def _watch(self, watch: _RoleWatch) -> None:
        """One watch request, until the server ends it; raises on failure (410 included)."""
        settings = self._settings
        async with Watch() as stream:
            events = stream.stream(
                self._core.list_namespaced_pod,
                self._namespace,
                label_selector=watch.selector,
                resource_version=watch.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=settings.watch_timeout_s,
                # a silent connection past the server's own timeout is a dead one
                _request_timeout=(
                    settings.request_timeout_s,
                    settings.watch_timeout_s + settings.request_timeout_s,
                ),
            )
            async for event in events:
                if not isinstance(event, dict):
                    raise WatchProtocolError(f"not a watch event: {str(event)[:200]!r}")
                kind, pod = event.get("type"), event.get("object")
                if kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(pod, V1Pod):
                    await self._apply(watch, kind, pod)
                # every event, BOOKMARK included, moves the resourceVersion (the client's own)
                watch.resource_version, watch.from_list = stream.resource_version, False

    async def _apply(self, watch: _RoleWatch, kind: str, pod: V1Pod) -> None:
        uid = _uid(pod)
        if kind == "DELETED":
            watch.skipped.pop(uid, None)
            await self._drain(watch, uid, "pod deleted")
            return
        try:
            worker = worker_from_pod(pod, watch.role)
        except PodSkipped as exc:
            self._note_skipped(watch, uid, pod_name(pod), str(exc))
            await self._drain(watch, uid, f"skipped: {exc}")
            return
        watch.skipped.pop(uid, None)
        if worker is None:
            await self._drain(watch, uid, "no pod IP")
        elif worker.not_ready is not None:
            await self._drain(watch, uid, worker.not_ready)
        else:
            await self._add(watch, uid, pod_name(pod), worker)

    async def _add(self, watch: _RoleWatch, uid: str, name: str, worker: PodWorker) -> None:
        wid = worker_id(worker.role, worker.url)
        known = watch.tracked.get(uid)
        if known is not None and known.worker_id != wid:
            await self._drain(watch, uid, f"its address changed to {worker.url}")
        await self._service.add_worker(
            worker.role,
            worker.url,
            bootstrap_port=worker.bootstrap_port,
            bootstrap_namespace=worker.bootstrap_namespace,
            source="kubernetes",
            kv_events=worker.kv_events,
            kv_events_replay=worker.kv_events_replay,
            models=worker.models,
        )
        if known is None or known.worker != worker:
            logger.info(
                "pod %s is Ready: %s worker %s added", name, worker.role, redact_url(worker.url)
            )
        watch.tracked[uid] = _Tracked(wid, name, worker)

    async def _drain(self, watch: _RoleWatch, uid: str, reason: str) -> None:
        """Drain the worker pod ``uid`` produced, if any (gone already: fine)."""
        known = watch.tracked.get(uid)
        if known is None:
            return
        logger.info(
            "pod %s: %s; draining %s worker %s",
            known.pod,
            reason,
            watch.role,
            redact_url(known.worker.url),
        )
        with contextlib.suppress(NotFound):
            await self._service.drain(known.worker_id)
        del watch.tracked[uid]

    async def _drain_orphans(self, watch: _RoleWatch) -> None:
        live = {known.worker_id for known in watch.tracked.values()}
        for record in await self._service.list_workers():
            if record.source != "kubernetes" or record.role != watch.role:
                continue
            if record.draining or record.id in live:
                continue
            logger.info(
                "%s worker %s: no Ready pod matches %r any more; draining",
                record.role,
                redact_url(record.url),
                watch.selector,
            )
            with contextlib.suppress(NotFound):
                await self._service.drain(record.id)

    def _note_skipped(self, watch: _RoleWatch, uid: str, name: str, reason: str) -> None:
        if watch.skipped.get(uid) != reason:
            logger.warning("pod %s: not a %s worker: %s", name, watch.role, reason)
        watch.skipped[uid] = reason

    def _set_error(self, watch: _RoleWatch, error: str | None) -> None:
        watch.error = error
        errors = [f"{w.role} pods: {w.error}" for w in self._roles if w.error]
        ok = not errors and all(w.synced for w in self._roles)
        status = self.status
        if ok != status.ok:
            if ok:
                logger.info("kubernetes API reachable; %s pods synchronised", status.namespace)
            status.since = time.time()
        status.ok, status.error = ok, "; ".join(errors) or None


def _continue_from(token: str | None) -> dict[str, Any]:
    """The list's next page (no ``continue`` parameter at all for the first)."""
    return {} if token is None else {"_continue": token}


def _uid(pod: V1Pod) -> str:
    meta = pod.metadata
    return (meta.uid if meta is not None else None) or pod_name(pod)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"kubernetes API answered {exc.status} {exc.reason}".strip()
    if isinstance(exc, TimeoutError):
        return "kubernetes API timed out"
    return str(exc) or repr(exc)
