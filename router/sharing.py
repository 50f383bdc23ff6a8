"""What a router shares with those routing beside it: the other processes of its host
(``router --workers N``: the bus, and each process's view for the merged ``/status``) and its
replicas elsewhere (``router.fleet.replica_sync``, ``--replica-listen``)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from registry.backends import RegistryStore
from router.fleet.circuit_breaker import Circuits
from router.fleet.engine_load import EngineLoadMonitor
from router.fleet.health import HealthProber
from router.fleet.host_probes import HostProbes, ProbeRound
from router.fleet.outlier import OutlierDetector
from router.fleet.replica_peers import ReplicaPeers
from router.fleet.replica_sync import ReplicaSync
from router.fleet.shared_breakers import BreakerVerdict, share_breakers
from router.fleet.shared_ejections import EjectionVerdict, share_ejections
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.shared_predictions import Prediction, SharedPredictions
from router.observability.metrics import RouterMetrics
from router.observability.recent_traffic import RecentTraffic
from router.observability.replica_metrics import ReplicaSyncCollector
from router.observability.siblings import Siblings
from router.process_role import ProcessRole
from router.server.lifecycle import RouterLifecycle
from router.settings import RouterSettings
from router.sibling_bus import SiblingBus
from router.upstream.base import UpstreamPool

__all__ = [
    "HOST_BUS_KINDS",
    "host_bus",
    "probe_tasks",
    "replica_sync",
    "share_predictions",
    "share_verdicts",
    "sibling_view",
]

# what travels on the host's bus (router.sibling_bus)
HOST_BUS_KINDS = (Prediction, BreakerVerdict, EjectionVerdict, ProbeRound)


def sibling_view(
    role: ProcessRole | None,
    lifecycle: RouterLifecycle,
    metrics: RouterMetrics,
    bus: SiblingBus | None,
    replicas: ReplicaSync | None = None,
    probes: HostProbes | None = None,
    traffic: RecentTraffic | None = None,
    ready: Callable[[], bool] = lambda: True,
) -> Siblings | None:
    """This process's part of the host's merged views (None: a router on its own)."""
    if role is None:
        return None
    started = time.time()

    def describe() -> dict[str, Any]:
        return {
            "index": role.index,
            "pid": os.getpid(),
            "started": started,
            "requests_inflight": lifecycle.inflight,
            "requests_served": lifecycle.served,
            "joined": lifecycle.joined,  # it listens on the client port
            "ready": ready(),  # it can route: a healthy prefill and decode known
            "bus": None if bus is None else bus.stats(),
            # --replica-listen: whether this process hears the peers, and publishes the host's
            "replicas": None if replicas is None else replicas.summary(),
            # the host's probes: whether this process probes for it (the leader), the rounds it
            # sent or took, and (a follower) its own rounds while the leader was silent
            "probes": None if probes is None else probes.stats(),
            # its recent-traffic window, merged into the host's (``/status/data`` ``traffic``)
            "traffic": None if traffic is None else traffic.raw(),
        }

    return Siblings(role, metrics.render, describe)


def host_bus(role: ProcessRole) -> SiblingBus:
    """The host's bus: breaker verdicts (``share_breakers``), outlier ejections
    (``share_ejections``), the leader's probe rounds, and predictions when they are shared
    (``share_predictions``)."""
    return SiblingBus(role, HOST_BUS_KINDS)


def probe_tasks(
    settings: RouterSettings,
    pool: UpstreamPool,
    prober: HealthProber,
    load_monitor: EngineLoadMonitor,
    host: tuple[ProcessRole, SiblingBus] | None,
) -> tuple[list[Coroutine[Any, Any, None]], HostProbes | None]:
    """The health probe and engine load loops this process runs: its own (on its own, or the
    host's leader, process 0, which also publishes them), or following the leader's
    (``router.fleet.host_probes``); and the host's probes object (None: on its own)."""
    features = settings.features
    polls = features.engine_load and settings.load.interval_s > 0

    def own() -> list[Coroutine[Any, Any, None]]:
        loops = [prober.run()] if features.health else []
        return loops + ([load_monitor.run()] if features.engine_load else [])

    if host is None or not (features.health or polls):
        return own(), None
    role, bus = host
    intervals = [settings.health.interval_s] if features.health else []
    intervals += [settings.load.interval_s] if polls else []

    async def probe_round() -> None:
        rounds = [prober.probe_all()] if features.health else []
        await asyncio.gather(*rounds, *([load_monitor.poll_all()] if polls else []))

    leader = role.index == 0
    probes = HostProbes(
        pool, bus, leader=leader, interval_s=min(intervals), probe=probe_round,
        on_back=prober.on_back, probed=lambda: not features.health or prober.rounds > 0,
        caches=load_monitor.caches,
    )  # fmt: skip
    if not leader:
        return [probes.run()], probes
    prober.on_verdict = probes.changed  # a verdict reaches the siblings at once
    return [*own(), probes.run()], probes


def share_predictions(
    settings: RouterSettings,
    index: KVBlockIndex,
    host: SiblingBus | None,
    fleet: ReplicaSync | None,
) -> None:
    """With ``PDR_CACHE__SHARE_PREDICTIONS``: the index's predictions go to the siblings and
    the replica peers, and theirs come into it (``router.kv_cache.shared_predictions``)."""
    if settings.cache.share_predictions and (host is not None or fleet is not None):
        SharedPredictions(index, host, fleet)


def replica_sync(
    settings: RouterSettings,
    pool: UpstreamPool,
    metrics: RouterMetrics,
    store: RegistryStore,
    role: ProcessRole | None,
) -> ReplicaSync | None:
    """This replica's end of the replicas' sync (None without ``--replica-listen``); the pool's
    counts include the peers' from now on, and the metrics tell how the sync is; the peers are
    found by flag, DNS or the registry (``store``). With ``router --workers N`` every process
    follows the peers and process 0 alone publishes the host's state (and registers it)."""
    if settings.replicas.listen is None:
        return None
    publishes = role is None or role.index == 0
    kinds = (BreakerVerdict, EjectionVerdict, Prediction)
    sync = ReplicaSync(settings.replicas, pool.all, publishes=publishes, kinds=kinds)
    sync.finder = ReplicaPeers(
        settings.replicas, sync.set_peers, store, settings.registry.ttl_s, register=publishes
    )
    pool.count_fleet(sync)
    metrics.registry.register(ReplicaSyncCollector(sync))
    return sync


def share_verdicts(
    circuits: Circuits,
    outlier: OutlierDetector,
    pool: UpstreamPool,
    host: SiblingBus | None,
    fleet: ReplicaSync | None,
) -> None:
    """The breakers and the outlier detector follow the siblings' and the replica peers'
    verdicts and tell them theirs (``router.fleet.shared_breakers``,
    ``router.fleet.shared_ejections``)."""
    if host is not None or fleet is not None:
        share_breakers(circuits, pool.get, host=host, fleet=fleet)
        share_ejections(outlier, pool.get, host=host, fleet=fleet)
