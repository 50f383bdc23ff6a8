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

__all__ = ["host_bus", "replica_sync", "share_predictions", "share_verdicts", "sibling_view"]


def sibling_view(
    role: ProcessRole | None,
    lifecycle: RouterLifecycle,
    metrics: RouterMetrics,
    bus: SiblingBus | None,
    replicas: ReplicaSync | None = None,
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
            # --replica-listen: whether this process hears the peers, and publishes the host's
            "replicas": None if replicas is None else replicas.summary(),
        }

    return Siblings(role, metrics.render, describe)


def host_bus(role: ProcessRole) -> SiblingBus:
    """The host's bus: breaker verdicts (``share_breakers``), and predictions when they are
    shared (``share_predictions``)."""
    return SiblingBus(role, (Prediction, BreakerVerdict))


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
    kinds = (BreakerVerdict, Prediction)
    sync = ReplicaSync(settings.replicas, pool.all, publishes=publishes, kinds=kinds)
    sync.finder = ReplicaPeers(
        settings.replicas, sync.set_peers, store, settings.registry.ttl_s, register=publishes
    )
    pool.count_fleet(sync)
    metrics.registry.register(ReplicaSyncCollector(sync))
    return sync


def share_verdicts(
    circuits: Circuits, pool: UpstreamPool, host: SiblingBus | None, fleet: ReplicaSync | None
) -> None:
    """The breakers follow the siblings' and the replica peers' verdicts and tell them theirs
    (``router.fleet.shared_breakers``)."""
    if host is not None or fleet is not None:
        share_breakers(circuits, pool.get, host=host, fleet=fleet)
