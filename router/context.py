"""The lifespan-owned context: everything a request needs, built once, closed on shutdown.

``open_context`` builds the parts (``_build_parts``: the pool, the fleet's watchers, the KV
cache view, the routing pipeline, the telemetry), binds the registry store, seeds discovery,
starts the background loops and the bootstrap listeners, yields the :class:`AppContext` and
closes everything in order on exit (``_close``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from registry.backends import RegistryStore, open_store
from registry.engine_api import RankTables
from registry.service import RegistryService
from router.adapters import build_adapter
from router.fleet.circuit_breaker import Circuits, build_circuits
from router.fleet.discovery import Discovery
from router.fleet.engine_cache import EngineCaches
from router.fleet.engine_load import EngineLoadMonitor
from router.fleet.health import HealthProber
from router.fleet.outlier import OutlierDetector
from router.fleet.replica_sync import ReplicaSync
from router.kv_cache.event_feed import KVEventFeed
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.load_board import LoadBoard, board_path
from router.observability.agreement import AgreementBoard
from router.observability.metrics import RouterMetrics
from router.observability.pair_ledger import PairLedger
from router.observability.recent_traffic import RecentTraffic
from router.observability.request_accounting import RequestAccounting
from router.observability.routing_states import RoutingStates, predicts_cache, routing_states
from router.observability.siblings import Siblings
from router.observability.state_metrics import RouterStateCollector
from router.observability.tracing import Tracer, build_tracer
from router.pipeline.admission import AdmissionGate
from router.pipeline.serve import Pipeline
from router.process_role import JOIN_WAIT_S, ProcessRole, until_ready
from router.scheduling.features import Featurizer
from router.scheduling.policies import build_policies
from router.scheduling.tokenizers import open_token_source
from router.server.bootstrap_listeners import bootstrap_servers, pool_owner_hosts
from router.server.lifecycle import RouterLifecycle
from router.settings import AdmissionSettings, RouterSettings
from router.sharing import (
    host_bus,
    probe_tasks,
    replica_sync,
    share_predictions,
    share_verdicts,
    sibling_view,
)
from router.tenancy.client_auth import ClientGate, client_gate, serving_clients
from router.upstream.base import UpstreamPool

if TYPE_CHECKING:
    from router.fleet.kube.pod_watch import PodWatcher

__all__ = ["AppContext", "FleetView", "KVCacheView", "Telemetry", "open_context"]


@dataclass(frozen=True, slots=True)
class FleetView:
    """How the workers are found and watched: the registry, discovery, health probing and, with
    ``--discovery k8s``, the pod watcher."""

    registry: RegistryService
    discovery: Discovery
    prober: HealthProber
    pod_watcher: PodWatcher | None = None  # --discovery k8s
    replicas: ReplicaSync | None = None  # --replica-listen: the replicas' sync


@dataclass(frozen=True, slots=True)
class KVCacheView:
    """What the router knows of the prefills' KV caches: the block index, the event feed that
    fills it, and the engines' own prefix-cache counters (read with their load)."""

    index: KVBlockIndex
    feed: KVEventFeed
    engines: EngineCaches = field(default_factory=EngineCaches)


@dataclass(frozen=True, slots=True)
class Telemetry:
    """What the router reports: metrics, the P<->D pair ledger, recent traffic, per-request
    accounting and (when on) tracing."""

    metrics: RouterMetrics
    pairs: PairLedger
    traffic: RecentTraffic
    accounting: RequestAccounting
    tracer: Tracer | None
    states: RoutingStates  # EXACT / DEGRADED / FALLBACK per prefill rank and pool
    siblings: Siblings | None = None  # router --workers N: the other processes of this host
    # predicted against actual cached tokens per prefill rank (this process's requests)
    agreement: AgreementBoard = field(default_factory=AgreementBoard)


@dataclass(frozen=True, slots=True)
class AppContext:
    """What the routes serve requests with: the settings, the lifecycle, the worker pool, the
    routing pipeline and its admission gate, and the fleet, KV cache and telemetry groups."""

    settings: RouterSettings
    lifecycle: RouterLifecycle
    pool: UpstreamPool
    pipeline: Pipeline
    admission: AdmissionGate
    fleet: FleetView
    kv: KVCacheView
    telemetry: Telemetry
    clients: ClientGate | None = None  # --api-keys: client keys required (None: open)


@contextlib.asynccontextmanager
async def _background(*coros: Any) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(coro) for coro in coros]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _open_pod_watcher(
    settings: RouterSettings, service: RegistryService
) -> PodWatcher | None:
    if settings.discovery != "k8s":
        return None
    from router.fleet.kube.pod_watch import open_pod_watcher  # noqa: PLC0415 - a slow import

    return await open_pod_watcher(settings.kubernetes, service)


@dataclass(frozen=True, slots=True)
class _Parts:
    """What ``open_context`` builds before it starts anything, and closes on exit."""

    pool: UpstreamPool
    store: RegistryStore
    fleet: FleetView  # without the pod watcher: that one is opened after the seeding
    load_monitor: EngineLoadMonitor
    featurizer: Featurizer
    kv: KVCacheView
    telemetry: Telemetry
    pipeline: Pipeline
    outlier: OutlierDetector
    board: LoadBoard | None  # router --workers N: the host's shared counts


def _live_ids(pool: UpstreamPool) -> set[str]:
    return {w.id for w in (*pool.prefill, *pool.decode)}


def _build_pool(
    admission: AdmissionSettings, needs_engine_ids: bool, board: LoadBoard | None
) -> UpstreamPool:
    return UpstreamPool(
        needs_engine_ids=needs_engine_ids,
        caps=admission.worker_caps(),
        capacity_backoff_s=admission.capacity_backoff_s,
        retry_after_s=admission.retry_after_s,
        board=board,
    )


def _build_circuits(
    settings: RouterSettings, pool: UpstreamPool, metrics: RouterMetrics
) -> Circuits:
    return build_circuits(
        settings.health,
        settings.breaker,
        live_ids=lambda: _live_ids(pool),
        on_transition=lambda scope, to: metrics.count(metrics.circuit_transitions, scope, to),
        enabled=settings.features.breakers,
    )


def _build_fleet(
    settings: RouterSettings,
    tables: RankTables,
    pool: UpstreamPool,
    metrics: RouterMetrics,
    role: ProcessRole | None,
) -> tuple[RegistryStore, FleetView, EngineLoadMonitor]:
    """The registry store (not bound yet) and the fleet's watchers (not started); ``role``:
    this process's place among ``router --workers N``'s (None: on its own)."""
    token = settings.registry.store_token
    store = open_store(settings.registry.url, token=token.get_secret_value() if token else None)
    service = RegistryService(store)
    prober = HealthProber(pool, settings.engine, settings.health, tables, store, settings.auth)
    discovery = Discovery(pool, service, settings, prober)
    load_monitor = EngineLoadMonitor(pool, settings.engine, settings.load,
                                     read_caches=predicts_cache(settings))  # fmt: skip
    fleet = FleetView(
        registry=service,
        discovery=discovery,
        prober=prober,
        replicas=replica_sync(settings, pool, metrics, store, role),
    )
    return store, fleet, load_monitor


def _build_telemetry(
    settings: RouterSettings, pool: UpstreamPool, metrics: RouterMetrics, kv: KVCacheView,
    fleet: FleetView, circuits: Circuits,
) -> Telemetry:  # fmt: skip
    observability = settings.observability
    pairs = PairLedger(observability.suspect_window_s, lambda: _live_ids(pool))
    traffic = RecentTraffic(observability.traffic_window_s, observability.traffic_bucket_s)
    agreement = AgreementBoard(observability.agreement_window)
    telemetry = Telemetry(
        metrics=metrics,
        pairs=pairs,
        traffic=traffic,
        # the traffic window still exists (the status page shows it empty) when it is off
        accounting=RequestAccounting(metrics, traffic if settings.features.traffic else None),
        tracer=build_tracer(settings.tracing),
        agreement=agreement,
        states=routing_states(settings, lambda: pool.prefill, kv.feed, kv.index, agreement,
                              partial(metrics.count, metrics.routing_state_transitions),
                              kv.engines),
    )  # fmt: skip
    state = (pairs, kv.index, kv.feed, lambda: fleet.discovery.status, circuits)
    metrics.registry.register(RouterStateCollector(pool, *state, agreement, telemetry.states))
    return telemetry


def _build_parts(
    settings: RouterSettings,
    tables: RankTables,
    board: LoadBoard | None,
    role: ProcessRole | None = None,
) -> _Parts:
    """Build every part; nothing starts, nothing is sent."""
    adapter = build_adapter(settings.engine)
    pool = _build_pool(settings.admission, adapter.needs_engine_ids, board)
    metrics = RouterMetrics(enabled=settings.features.metrics)
    circuits = _build_circuits(settings, pool, metrics)
    store, fleet, load_monitor = _build_fleet(settings, tables, pool, metrics, role)
    cache = settings.cache
    index = KVBlockIndex(cache.max_indexed_blocks, cache.prediction_ttl_s)
    tree = ApproxPrefixTree(cache.approx_tree_max_chars)
    policies = partial(build_policies, settings.policy, cache, index, tree)
    featurizer = Featurizer(open_token_source(cache), metrics.tokenize_seconds.observe)
    feed = KVEventFeed(lambda: pool.prefill, index, tree, cache)
    kv = KVCacheView(index=index, feed=feed, engines=load_monitor.caches)
    telemetry = _build_telemetry(settings, pool, metrics, kv, fleet, circuits)
    fleet.prober.on_back = circuits.worker_back
    pipeline = Pipeline(
        pool,
        adapter,
        policies,
        settings.upstream,
        settings.health,
        fleet.prober.refresh_soon,
        metrics,
        cache_settings=cache,
        featurizer=featurizer,
        pairs=telemetry.pairs,
        observability=settings.observability,
        circuits=circuits,
        receipts=settings.features.receipts,
        session_settings=settings.session,
        model_aliases=settings.policy.model_aliases,
        agreement=telemetry.agreement,
        admission=settings.admission,
    )
    outlier = OutlierDetector(
        pool,
        settings.outlier,
        on_eject=lambda role, why: metrics.count(metrics.outlier_ejections, role, why),
    )
    return _Parts(
        pool=pool,
        store=store,
        fleet=fleet,
        load_monitor=load_monitor,
        featurizer=featurizer,
        kv=kv,
        telemetry=telemetry,
        pipeline=pipeline,
        outlier=outlier,
        board=board,
    )


async def _close(parts: _Parts, tables: RankTables) -> None:
    """Close what ``_build_parts`` built (the pod watcher is closed first, by the caller)."""
    tracer = parts.telemetry.tracer
    if tracer is not None:
        await tracer.aclose()
    tables.bind(None)
    await parts.kv.feed.aclose()
    await parts.featurizer.aclose()
    await parts.fleet.discovery.aclose()
    await parts.fleet.prober.aclose()
    await parts.load_monitor.aclose()
    await parts.store.close()
    if parts.board is not None:
        parts.board.close()


def _app_context(
    settings: RouterSettings,
    lifecycle: RouterLifecycle,
    parts: _Parts,
    pod_watcher: PodWatcher | None,
    siblings: Siblings | None,
) -> AppContext:
    replicas = parts.fleet.replicas
    admission = AdmissionGate(
        settings.admission,
        parts.telemetry.metrics,
        board=parts.board,
        peers=None if replicas is None else replicas.units,
    )
    if replicas is not None:
        replicas.own_units = admission.host_units
    return AppContext(
        settings=settings,
        lifecycle=lifecycle,
        pool=parts.pool,
        pipeline=parts.pipeline,
        admission=admission,
        fleet=replace(parts.fleet, pod_watcher=pod_watcher),
        kv=parts.kv,
        telemetry=replace(parts.telemetry, siblings=siblings),
    )


@contextlib.asynccontextmanager
async def open_context(
    settings: RouterSettings,
    tables: RankTables,
    lifecycle: RouterLifecycle,
    role: ProcessRole | None = None,
) -> AsyncIterator[AppContext]:
    """Build the context, start probing and registry sync, and tear all down on exit; ``role``:
    this process's place among ``router --workers N``'s (None: on its own)."""
    sharing = role if settings.features.host_sharing else None
    board = (
        None
        if sharing is None
        else LoadBoard(board_path(sharing.run_dir), sharing.count, sharing.index)
    )
    parts = _build_parts(settings, tables, board, role)
    clients = client_gate(settings.auth)  # a bad keys file stops the start here
    bus = None if sharing is None else host_bus(sharing)
    fleet = parts.fleet
    share_verdicts(parts.pipeline.circuits, parts.outlier, parts.pool, bus, fleet.replicas)
    share_predictions(settings, parts.kv.index, bus, fleet.replicas)
    tables.bind(parts.store)
    pod_watcher = None
    try:
        await fleet.discovery.seed()
        pod_watcher = await _open_pod_watcher(settings, fleet.registry)
        features = settings.features
        tasks = [fleet.discovery.run(), parts.kv.feed.run(), parts.telemetry.states.run()]
        host = None if sharing is None or bus is None else (sharing, bus)
        probing, probes = probe_tasks(settings, parts.pool, fleet.prober, parts.load_monitor, host)
        tasks += probing
        tasks += [parts.outlier.run()] if features.outliers else []
        tasks += [bus.run()] if bus is not None else []
        tasks += [fleet.replicas.run()] if fleet.replicas is not None else []
        tasks += [clients.keys.watch()] if clients is not None else []
        if pod_watcher is not None:
            tasks.append(pod_watcher.run())
        background = _background(*tasks)
        listeners = bootstrap_servers(
            tables, settings, pool_owner_hosts(parts.pool), reuse_port=role is not None
        )
        seen, ready = parts.telemetry, parts.pool.ready
        siblings = sibling_view(
            role, lifecycle, seen.metrics, bus, fleet.replicas, probes, seen.traffic, ready
        )
        answering = siblings.serving() if siblings is not None else contextlib.nullcontext()
        async with listeners, background, answering:
            if role is not None:  # its socket listens once this returns: when it can route
                await until_ready(parts.pool, JOIN_WAIT_S)
            lifecycle.joined = True
            context = _app_context(settings, lifecycle, parts, pod_watcher, siblings)
            async with serving_clients(clients):
                yield replace(context, clients=clients)
    finally:
        if pod_watcher is not None:
            await pod_watcher.aclose()
        if bus is not None:
            bus.close()
        if fleet.replicas is not None:
            fleet.replicas.close()
        await _close(parts, tables)
