"""What a router shares with those routing beside it: the other processes of its host
(``router --workers N``: the bus, and each process's view for the merged ``/status``) and its
replicas elsewhere (``router.fleet.replica_sync``, ``--replica-listen``)."""

from __future__ import annotations

import os
import time
from typing import Any

from registry.backends import RegistryStore
from router.fleet.circuit_breaker import Circuits
from router.fleet.replica_peers import ReplicaPeers
from router.fleet.replica_sync import ReplicaSync
from router.fleet.shared_breakers import BreakerVerdict, share_breakers
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.shared_predictions import Prediction, SharedPredictions
from router.observability.metrics import RouterMetrics
from router.observability.replica_metrics import ReplicaSyncCollector
from router.observability.siblings import Siblings
from router.process_role import ProcessRole
from router.server.lifecycle import RouterLifecycle
from router.settings import RouterSettings
from router.sibling_bus import SiblingBus
from router.upstream.base import UpstreamPool

__all__ = ["host_bus", "replica_sync", "sibling_view"]


def sibling_view(
    role: ProcessRole | None,
    lifecycle: RouterLifecycle,
    metrics: RouterMetrics,
    bus: SiblingBus | None,
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
            "bus": None if bus is None else bus.stats(),
        }

    return Siblings(role, metrics.render, describe)


def host_bus(
    role: ProcessRole,
    settings: RouterSettings,
    circuits: Circuits,
    pool: UpstreamPool,
    index: KVBlockIndex,
) -> SiblingBus:
    """The host's bus: breaker verdicts, and predictions when they are shared."""
    bus = SiblingBus(role, (Prediction, BreakerVerdict))
    share_breakers(circuits, bus, pool.get)
    if settings.cache.share_predictions:
        SharedPredictions(index, bus)
    return bus


def replica_sync(
    settings: RouterSettings,
    pool: UpstreamPool,
    metrics: RouterMetrics,
    circuits: Circuits,
    store: RegistryStore,
) -> ReplicaSync | None:
    """This replica's end of the replicas' sync (None without ``--replica-listen``); the pool's
    counts include the peers' from now on, the breakers follow theirs, and the metrics tell how
    the sync is; the peers are found by flag, DNS or the registry (``store``)."""
    if settings.replicas.listen is None:
        return None
    sync = ReplicaSync(settings.replicas, pool.all)
    sync.finder = ReplicaPeers(settings.replicas, sync.set_peers, store, settings.registry.ttl_s)
    pool.count_fleet(sync)
    share_breakers(circuits, sync, pool.get)
    metrics.registry.register(ReplicaSyncCollector(sync))
    return sync
