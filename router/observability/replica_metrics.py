"""Scrape-time metrics of the replicas' sync (``router.fleet.replica_sync``): the peers heard,
how old and how late their state is, what was missed or refused, and whether this replica is
degraded. Label values are the peers' replica names (bounded by the configured peers)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.fleet.replica_sync import ReplicaSync

__all__ = ["ReplicaSyncCollector"]


class ReplicaSyncCollector(Collector):
    def __init__(self, sync: ReplicaSync) -> None:
        self._sync = sync

    def collect(self) -> Iterator[Metric]:
        stats = self._sync.stats()
        peers = stats["peers"]
        fresh = GaugeMetricFamily(
            "pdr_replica_peers", "Replica peers by state: fresh (heard within stale_s) or stale",
            labels=["state"],
        )  # fmt: skip
        heard = sum(1 for peer in peers if peer["fresh"])
        fresh.add_metric(["fresh"], heard)
        fresh.add_metric(["stale"], len(stats["peer_addresses"]) - heard)
        yield fresh
        degraded = GaugeMetricFamily(
            "pdr_replica_degraded",
            "1 while a configured replica peer is not heard (this replica routes without its "
            "state)",
        )
        degraded.add_metric([], 1 if stats["degraded"] else 0)
        yield degraded
        age = GaugeMetricFamily(
            "pdr_replica_state_age_seconds",
            "Age of the peer's state this replica routes with (since its last snapshot arrived)",
            labels=["peer"],
        )
        lag = GaugeMetricFamily(
            "pdr_replica_sync_lag_seconds",
            "The peer's last snapshot's age on arrival (by the sender's clock)",
            labels=["peer"],
        )
        gaps = CounterMetricFamily(
            "pdr_replica_sync_gaps", "Snapshots of the peer this replica missed", labels=["peer"]
        )
        for peer in peers:
            name = peer["replica"]
            if peer["age_s"] is not None:
                age.add_metric([name], peer["age_s"])
            if peer["lag_s"] is not None:
                lag.add_metric([name], peer["lag_s"])
            gaps.add_metric([name], peer["gaps"])
        yield from (age, lag, gaps)
        rejected = CounterMetricFamily(
            "pdr_replica_sync_rejected",
            "Messages dropped for a missing or wrong HMAC (--replica-token) or an unreadable body",
        )
        rejected.add_metric([], stats["rejected"])
        yield rejected
