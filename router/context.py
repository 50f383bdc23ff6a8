"""The lifespan-owned context: everything a request needs, built once, closed on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.backends import open_store
from registry.engine_api import RankTables
from registry.service import RegistryService
from router.adapters import build_adapter
from router.fleet.circuit_breaker import build_circuits
from router.fleet.discovery import Discovery
from router.fleet.engine_load import EngineLoadMonitor
from router.fleet.health import HealthProber
from router.kv_cache.event_feed import KVEventFeed
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.observability.metrics import RouterMetrics
from router.observability.pair_ledger import PairLedger
from router.observability.recent_traffic import RecentTraffic
from router.observability.request_accounting import RequestAccounting
from router.observability.state_metrics import RouterStateCollector
from router.observability.tracing import Tracer, build_tracer
from router.pipeline.admission import AdmissionGate
from router.pipeline.serve import Pipeline
from router.scheduling.features import Featurizer, open_token_source
from router.scheduling.policies import build_policies
from router.server.bootstrap_listeners import bootstrap_servers, pool_owner_hosts
from router.server.lifecycle import RouterLifecycle
from router.settings import RouterSettings
from router.upstream.base import UpstreamPool

if TYPE_CHECKING:
    from router.fleet.kube.pod_watch import PodWatcher

__all__ = ["AppContext", "open_context"]


@dataclass(frozen=True, slots=True)
class AppContext:
    settings: RouterSettings
    pool: UpstreamPool
    pipeline: Pipeline
    prober: HealthProber
    registry: RegistryService
    discovery: Discovery
    metrics: RouterMetrics
    index: KVBlockIndex
    feed: KVEventFeed
    pairs: PairLedger
    traffic: RecentTraffic
    accounting: RequestAccounting
    tracer: Tracer | None
    lifecycle: RouterLifecycle
    admission: AdmissionGate
    pod_watcher: PodWatcher | None = None  # --discovery k8s

    def live_view(self, worker_id: str) -> dict[str, Any] | None:
        """This router's live state of a worker, for the admin API."""
        worker = self.pool.get(worker_id)
        if worker is None:
            return None
        view: dict[str, Any] = {
            "healthy": worker.healthy,
            "draining": worker.draining,
            "inflight": worker.inflight,
        }
        if worker.role.value == "prefill":
            view["dp_size"] = worker.dp_size
            view["ranks"] = [
                {
                    "dp_rank": rank,
                    "inflight": load,
                    # prompt tokens this router's in-flight prefill legs there will compute
                    "pending_prefill_tokens": worker.pending_tokens(rank),
                    "engine_id": worker.engine_ids[rank] if rank < len(worker.engine_ids) else None,
                    # confirmed blocks the KV index holds for this rank, and its event stream
                    "kv_blocks": self.index.block_count((worker.id, rank)),
                    "kv_events": self.feed.stats((worker.id, rank)),
                }
                for rank, load in enumerate(worker.rank_inflight)
            ]
        return view


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


@contextlib.asynccontextmanager
async def open_context(
    settings: RouterSettings, tables: RankTables, lifecycle: RouterLifecycle
) -> AsyncIterator[AppContext]:
    """Build the context, start probing and registry sync, and tear all down on exit."""
    adapter = build_adapter(settings.engine)
    admission = settings.admission
    pool = UpstreamPool(
        needs_engine_ids=adapter.needs_engine_ids,
        caps=admission.worker_caps(),
        capacity_backoff_s=admission.capacity_backoff_s,
        retry_after_s=admission.retry_after_s,
    )
    store = open_store(settings.registry.url)
    service = RegistryService(store)
    prober = HealthProber(pool, settings.engine, settings.health, tables)
    discovery = Discovery(pool, service, settings, prober)
    load_monitor = EngineLoadMonitor(pool, settings.engine, settings.load)
    metrics = RouterMetrics()
    cache = settings.cache
    index = KVBlockIndex(cache.max_indexed_blocks, cache.prediction_ttl_s)
    tree = ApproxPrefixTree(cache.approx_tree_max_chars)
    prefill_policy, decode_policy = build_policies(settings.policy, cache, index, tree)
    featurizer = Featurizer(open_token_source(cache), metrics.tokenize_seconds.observe)
    feed = KVEventFeed(lambda: pool.prefill, index, tree, cache)
    observability = settings.observability
    pairs = PairLedger(
        observability.suspect_window_s, lambda: {w.id for w in (*pool.prefill, *pool.decode)}
    )
    traffic = RecentTraffic(observability.traffic_window_s, observability.traffic_bucket_s)
    circuits = build_circuits(
        settings.health,
        settings.breaker,
        live_ids=lambda: {w.id for w in (*pool.prefill, *pool.decode)},
        on_transition=lambda scope, to: metrics.count(metrics.circuit_transitions, scope, to),
    )
    metrics.registry.register(
        RouterStateCollector(pool, pairs, index, feed, lambda: discovery.status, circuits)
    )
    tracer = build_tracer(settings.tracing)
    pipeline = Pipeline(
        pool,
        adapter,
        prefill_policy,
        decode_policy,
        settings.upstream,
        settings.health,
        prober.refresh_soon,
        metrics,
        cache_settings=cache,
        featurizer=featurizer,
        pairs=pairs,
        observability=observability,
        circuits=circuits,
    )
    tables.bind(store)
    pod_watcher = None
    try:
        await discovery.seed()
        pod_watcher = await _open_pod_watcher(settings, service)
        tasks = [prober.run(), discovery.run(), load_monitor.run(), feed.run()]
        if pod_watcher is not None:
            tasks.append(pod_watcher.run())
        background = _background(*tasks)
        listeners = bootstrap_servers(tables, settings, pool_owner_hosts(pool))
        async with listeners, background:
            yield AppContext(
                settings,
                pool,
                pipeline,
                prober,
                service,
                discovery,
                metrics,
                index,
                feed,
                pairs,
                traffic,
                RequestAccounting(metrics, traffic),
                tracer,
                lifecycle,
                AdmissionGate(admission, metrics),
                pod_watcher,
            )
    finally:
        if pod_watcher is not None:
            await pod_watcher.aclose()
        if tracer is not None:
            await tracer.aclose()
        tables.bind(None)
        await feed.aclose()
        await featurizer.aclose()
        await discovery.aclose()
        await prober.aclose()
        await load_monitor.aclose()
        await store.close()
