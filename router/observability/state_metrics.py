"""Scrape-time gauges and counters of the router's live state.

Read from the pool, the P<->D pair ledger, the circuit breakers, the KV index and event feed and
the registry status when Prometheus scrapes, never on the request path. A worker that leaves the
pool takes its series with it (and its pairs: the ledger and the breakers are pruned first), so
label values stay bounded by the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from router.fleet.circuit_breaker import Circuits, CircuitState
from router.fleet.discovery import RegistryStatus
from router.kv_cache.event_feed import KVEventFeed
from router.kv_cache.index import KVBlockIndex
from router.observability.agreement import ERROR_BUCKETS, AgreementBoard
from router.observability.pair_ledger import PairLedger
from router.observability.routing_states import RoutingState, RoutingStates
from router.upstream.base import UpstreamPool
from router.workers import Worker

__all__ = ["RouterStateCollector"]

_WORKER = ["role", "worker"]
_RANK = ["role", "worker", "dp_rank"]
_PAIR = ["prefill", "decode"]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _loop_tasks() -> Iterator[Metric]:
    """The asyncio tasks alive in the router's event loop (a leak shows as a climb while idle);
    nothing when collected outside the loop."""
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # no running loop: rendered from a thread or a test
        return
    yield GaugeMetricFamily(
        "pdr_event_loop_tasks", "asyncio tasks alive in the router's event loop", value=tasks
    )


class RouterStateCollector(Collector):
    def __init__(
        self,
        pool: UpstreamPool,
        pairs: PairLedger,
        index: KVBlockIndex,
        feed: KVEventFeed,
        registry_status: Callable[[], RegistryStatus],
        circuits: Circuits | None = None,
        agreement: AgreementBoard | None = None,
        states: RoutingStates | None = None,
    ) -> None:
        self._pool = pool
        self._states = states
        self._agreement = agreement
        self._circuits = circuits
        self._pairs = pairs
        self._index = index
        self._feed = feed
        self._registry_status = registry_status

    def collect(self) -> Iterator[Metric]:
        yield from _loop_tasks()
        workers = [*self._pool.prefill, *self._pool.decode]
        yield from self._workers(workers)
        yield from self._engines(workers)
        yield from self._prefill_ranks(self._pool.prefill)
        yield from self._pair_metrics()
        if self._circuits is not None:
            yield from self._circuit_metrics(self._circuits)
        if self._agreement is not None:
            yield from self._agreement_metrics(self._agreement)
        if self._states is not None:
            yield from _state_metrics(self._states)
        registry = _gauge("pdr_registry_up", "1 when the worker registry answers, else 0", [])
        registry.add_metric([], 1.0 if self._registry_status().ok else 0.0)
        yield registry

    def _workers(self, workers: list[Worker]) -> Iterator[Metric]:
        healthy = _gauge("pdr_worker_healthy", "1 when the worker takes requests", _WORKER)
        inflight = _gauge("pdr_worker_inflight", "Requests this router has in flight", _WORKER)
        draining = _gauge("pdr_worker_draining", "1 while the worker drains", _WORKER)
        for w in workers:
            labels = [w.role.value, w.public_url]
            healthy.add_metric(labels, 1.0 if w.healthy else 0.0)
            inflight.add_metric(labels, float(w.inflight))
            draining.add_metric(labels, 1.0 if w.draining else 0.0)
        yield from (healthy, inflight, draining)

    def _engines(self, workers: list[Worker]) -> Iterator[Metric]:
        """Each DP rank's last fresh load report from its engine (vLLM or SGLang metrics)."""
        running = _gauge(
            "pdr_engine_requests_running", "Requests running, as the engine reported", _RANK
        )
        waiting = _gauge(
            "pdr_engine_requests_waiting", "Requests waiting, as the engine reported", _RANK
        )
        usage = _gauge(
            "pdr_engine_kv_cache_usage_ratio", "KV cache in use (0..1), as reported", _RANK
        )
        fresh = _gauge(
            "pdr_engine_load_fresh", "1 when the rank's engine load reading is fresh", _RANK
        )
        now = time.monotonic()
        for w in workers:
            for rank, reading in enumerate(w.engine_load):
                labels = [w.role.value, w.public_url, str(rank)]
                ok = reading is not None and now < reading.fresh_until
                fresh.add_metric(labels, 1.0 if ok else 0.0)
                if reading is None or not ok:
                    continue
                running.add_metric(labels, reading.load.running)
                waiting.add_metric(labels, reading.load.waiting)
                if reading.load.kv_usage is not None:
                    usage.add_metric(labels, reading.load.kv_usage)
        yield from (running, waiting, usage, fresh)

    def _prefill_ranks(self, prefills: list[Worker]) -> Iterator[Metric]:
        labels = ["worker", "dp_rank"]
        pending = _gauge(
            "pdr_prefill_pending_tokens",
            "Prompt tokens this router's in-flight prefill legs are predicted to compute",
            labels,
        )
        blocks = _gauge(
            "pdr_kv_index_blocks",
            "KV blocks the router's index holds for the rank, per cache tier (medium)",
            [*labels, "medium"],
        )
        tiers = self._index.tiers()  # GPU, and the lower tiers once an event named them
        counters = {
            key: CounterMetricFamily(f"pdr_kv_events_{key}", doc, labels=labels)
            for key, doc in (
                ("batches", "KV event batches applied live"),
                ("lost", "KV event batches the publisher sent that never arrived"),
                ("replayed", "KV event batches recovered from the replay endpoint"),
                ("restarts", "Times the KV event publisher started over"),
            )
        }
        for w in prefills:
            for rank, tokens in enumerate(w.rank_pending_tokens):
                values = [w.public_url, str(rank)]
                # this process's own (--workers N: /metrics sums the processes')
                pending.add_metric(values, float(tokens))
                for tier in tiers:
                    count = self._index.block_count((w.id, rank), tier)
                    blocks.add_metric([*values, tier.medium], float(count))
                stats = self._feed.stats((w.id, rank))
                if stats is not None:
                    for key, family in counters.items():
                        family.add_metric(values, float(stats[key]))
        yield from (pending, blocks, *counters.values())

    def _pair_metrics(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "pdr_pd_requests", "PD requests per prefill and decode pair", labels=_PAIR
        )
        errors = CounterMetricFamily(
            "pdr_pd_errors", "PD requests that failed, per pair", labels=_PAIR
        )
        recomputes = CounterMetricFamily(
            "pdr_pd_recompute",
            "PD requests whose decode computed the prompt itself (the KV transfer did nothing)",
            labels=_PAIR,
        )
        suspect = _gauge(
            "pdr_pd_pair_suspect", "1 when the pair recomputed within the suspect window", _PAIR
        )
        now = time.monotonic()
        window = self._pairs.suspect_window_s
        for stats in self._pairs.pairs():
            labels = [stats.prefill_url, stats.decode_url]
            requests.add_metric(labels, float(stats.requests))
            errors.add_metric(labels, float(stats.errors))
            recomputes.add_metric(labels, float(stats.recomputes))
            suspect.add_metric(labels, 1.0 if stats.suspect(now, window) else 0.0)
        yield from (requests, errors, recomputes, suspect)

    def _circuit_metrics(self, circuits: Circuits) -> Iterator[Metric]:
        """1 while a breaker keeps traffic away (open, or half-open: one trial at a time). Only
        targets that ever failed have a breaker (and a series)."""
        workers = _gauge(
            "pdr_worker_circuit_open",
            "1 while the worker's circuit breaker is open or half-open (no normal traffic)",
            _WORKER,
        )
        pairs = _gauge(
            "pdr_pd_pair_circuit_open",
            "1 while the prefill->decode pair's circuit breaker is open or half-open",
            _PAIR,
        )
        for family, states in (
            (workers, circuits.worker_states()),
            (pairs, circuits.pair_states()),
        ):
            for labels, state in states:
                family.add_metric(list(labels), 0.0 if state is CircuitState.CLOSED else 1.0)
        yield from (workers, pairs)

    def _agreement_metrics(self, board: AgreementBoard) -> Iterator[Metric]:
        """Predicted against actual cached tokens per prefill rank (cumulative, this process's
        prefill legs; ``--workers N`` sums them)."""
        board.prune({w.id for w in self._pool.prefill})
        labels = ["worker", "dp_rank"]
        error = HistogramMetricFamily(
            "pdr_cache_prediction_error_ratio",
            "Per predicted prefill leg: |cached tokens the engine reported - cached tokens "
            "predicted at the chosen rank| / prompt tokens (which way: pdr_cache_*_tokens)",
            labels=labels,
        )
        counters = {
            key: CounterMetricFamily(f"pdr_cache_{key}", doc, labels=labels)
            for key, doc in (
                ("predicted_tokens", "Prompt tokens predicted cached at the chosen rank"),
                ("actual_tokens", "Prompt tokens the prefill's answer reported cached"),
                ("prompt_tokens", "Prompt tokens of those prefill legs, as the engine counted"),
                ("unreported", "Predicted prefill legs whose answer reported no cached tokens"),
            )
        }
        for (_, rank), agreement in board.items():
            values = [agreement.url, str(rank)]
            counts = [float(sum(agreement.buckets[: i + 1])) for i in range(len(ERROR_BUCKETS))]
            buckets = [(str(bound), n) for bound, n in zip(ERROR_BUCKETS, counts, strict=True)]
            buckets.append(("+Inf", float(agreement.reported)))
            error.add_metric(values, buckets, agreement.error_sum)
            counters["predicted_tokens"].add_metric(values, float(agreement.predicted_tokens))
            counters["actual_tokens"].add_metric(values, float(agreement.cached_tokens))
            counters["prompt_tokens"].add_metric(values, float(agreement.prompt_tokens))
            counters["unreported"].add_metric(values, float(agreement.unreported))
        yield from (error, *counters.values())


def _state_metrics(states: RoutingStates) -> Iterator[Metric]:
    """1 for each prefill rank's and pool's routing state at the last evaluation, 0 for the
    other states (router.observability.routing_states)."""
    ranks = _gauge(
        "pdr_routing_state",
        "1 for the prefill rank's routing state (exact, degraded, fallback), else 0",
        ["worker", "dp_rank", "state"],
    )
    pools = _gauge(
        "pdr_routing_pool_state",
        "1 for the pool's routing state (its worst rank's), else 0",
        ["pool", "state"],
    )
    for judged in states.ranks.values():
        for state in RoutingState:
            value = 1.0 if judged.state is state else 0.0
            ranks.add_metric([judged.worker, str(judged.dp_rank), state.value], value)
    for name, (current, _) in states.pools.items():
        for state in RoutingState:
            pools.add_metric([name, state.value], 1.0 if current is state else 0.0)
    yield from (ranks, pools)
