"""The status page's data: one JSON snapshot of the router's live state, built from its context.

``GET /status/data`` serves it and ``router/api/status_page.html`` renders it. The keys are stable
(the page and anyone scripting against it read them)::

    {
      "generated_at": 1700000000.0,          # time.time() when built; the page shows its age
      "engine": "sglang",                    # the PD protocol (--engine)
      "policy": {"prefill": "cache_aware", "decode": "least_load"},
      "ready": true,                         # what GET /ready says (a prefill and a decode up)
      "workers": {"prefill": [W, ...], "decode": [W, ...]},
      "pairs": [...],              # ctx.telemetry.pairs.snapshot(): per P<->D pair counters
      "traffic": {...},            # ctx.telemetry.traffic.snapshot(): rate, errors, TTFT buckets
      "registry": {"url": "memory://", "ok": true, "error": null, "since": 1700000000.0},
      "kv_events": [{"worker": url, "dp_rank": 0, **FeedStats.as_dict()}, ...],
      "admission": {"inflight": 3, "queued": 0, "limit": 1024,   # limit null: no limit
                    "max_queued": 2048, "queue_timeout_s": 30.0,
                    "queued_by_priority": {"high": 0, "normal": 0, "low": 0},
                    # --queue-at-worker-caps: admitted, waiting for a worker below its cap
                    "worker_queue": {"queued": 0, "queued_by_priority": {...}} | null},
      "circuits": [C, ...],                  # breakers open or half-open, as /ready lists them
      "processes": [P, ...] | null,          # router --workers N: the processes that answered
                                             # (null: a router of one process)
      "replicas": R | null,                  # --replica-listen: the replicas' sync (null: off)
      "sessions": {...} | null,              # the session pin table (null: affinity off)
      "tenants": [T, ...] | null             # --api-keys: its tenants, by name (null: off)
    }

    W = {"id", "url", "role", "healthy", "draining", "inflight", "dp_size",
         "models": [...], "adapters": [...],  # the names it serves ([]: any), its LoRA ones
         "ejected": bool,                    # out by outlier detection (healthy is false too)
         "full_retry_in_s": 0.8 | null,      # capacity back-off: it said it is full (429/503)
         "circuit": {"state", "reason", "retry_in_s"} | null,     # its breaker, unless closed
         "ranks": [{"dp_rank", "inflight",
                    "engine": {"running", "waiting", "kv_usage", "age_s"} | null,
                    "pending_prefill_tokens", "kv_blocks"}]}        # the last two: prefill only
    P = {"index", "pid", "started" (time.time()), "requests_inflight", "requests_served",
         "joined",                          # it listens on the client port (it can route)
         "bus": {"sent", "received", "dropped", "gaps", "lag_s"} | null,  # router.sibling_bus
         "replicas": {"publishes", "fresh", "degraded"} | null,  # this process's sync
         "probes": {"leader", "rounds", "fallbacks"} | null}  # router.fleet.host_probes
    R = {"replica", "listen", "publishes", "peer_addresses", "sent", "received", "rejected",
         "degraded": "1 of 1 replica peer(s) not heard within 1s" | null,
         "peers": [{"replica", "fresh", "age_s", "lag_s", "seq", "gaps", "restarts"}]}
    T = {"name", "priority", "min_priority", "weight",     # from the keys file (null: unset)
         "requests_per_minute", "tokens_per_minute", "max_concurrent",   # its limits
         "in_flight": 2,                     # its requests being served in this process
         "queued": 0}                        # waiting in the admission queue
    C = {"scope": "worker", "role", "worker"} | {"scope": "pair", "prefill", "decode"},
        plus {"state": "open" | "half_open", "reason", "retry_in_s" (null: half-open),
              "open_s", "trial_in_flight"}

``engine`` is null when the rank has no fresh load reading (never read, the read failed, or it
is older than ``--load-stale-after``): the router treats such a rank's load as unknown, and so
does the page. ``kv_events`` lists only the DP ranks whose KV event stream the router follows.
``full_retry_in_s`` is how long the router still avoids a worker that answered it is full (while
another candidate exists); null when it is not avoided.
"""

from __future__ import annotations

import time
from typing import Any

from registry.models import redact_url
from router.api.routing_health import routing_view
from router.context import AppContext
from router.kv_cache.event_feed import KVEventFeed
from router.kv_cache.index import KVBlockIndex
from router.pipeline.admission import AdmissionGate
from router.pipeline.worker_queue import WorkerQueue
from router.settings import AdmissionSettings
from router.workers import LoadReading, Role, Worker

__all__ = ["status_snapshot"]

_CIRCUIT_KEYS = ("state", "reason", "retry_in_s")  # of a worker's own breaker, in its row


def status_snapshot(ctx: AppContext) -> dict[str, Any]:
    """Everything the status page shows, as plain JSON-ready values."""
    now = time.monotonic()
    pool = ctx.pool
    registry = ctx.fleet.discovery.status
    circuits = [t.describe() for t in ctx.pipeline.circuits.tripped()]
    breakers = {(c["role"], c["worker"]): c for c in circuits if c["scope"] == "worker"}
    return {
        "generated_at": time.time(),
        "engine": ctx.settings.engine.value,
        "policy": ctx.pipeline.chooser.policy_names(),
        "ready": pool.ready(),
        "workers": {
            "prefill": [_worker(w, ctx.kv.index, now, breakers) for w in pool.prefill],
            "decode": [_worker(w, ctx.kv.index, now, breakers) for w in pool.decode],
        },
        "pairs": ctx.telemetry.pairs.snapshot(),
        "traffic": ctx.telemetry.traffic.snapshot(),
        "registry": {
            "url": redact_url(registry.url),
            "ok": registry.ok,
            "error": registry.error,
            "since": registry.since,
        },
        "kv_events": _kv_events(pool.prefill, ctx.kv.feed),
        "admission": _admission(ctx.admission, ctx.settings.admission, ctx.pipeline.worker_queue),
        "circuits": circuits,
        "replicas": None if ctx.fleet.replicas is None else ctx.fleet.replicas.stats(),
        # this process's session pin table (None: session affinity off)
        "sessions": None if ctx.pipeline.sessions is None else ctx.pipeline.sessions.pins.stats(),
        "tenants": _tenants(ctx),
        # EXACT / DEGRADED / FALLBACK per prefill rank and pool, with the reasons
        "routing": routing_view(ctx),
    }


def _tenants(ctx: AppContext) -> list[dict[str, Any]] | None:
    """The tenants of ``--api-keys`` (None: off) with their limits and what they use now."""
    clients = ctx.clients
    if clients is None:
        return None
    queued = ctx.admission.queued_by_tenant()
    limiter = clients.limiter
    return [
        {
            "name": name,
            "priority": spec.priority,
            "min_priority": spec.min_priority,
            "weight": spec.weight,
            "requests_per_minute": spec.requests_per_minute,
            "tokens_per_minute": spec.tokens_per_minute,
            "max_concurrent": spec.max_concurrent,
            "in_flight": None if limiter is None else limiter.in_flight(name),
            "queued": queued.get(name, 0),
        }
        for name, spec in sorted(clients.keys.table.specs.items())
    ]


def _admission(
    gate: AdmissionGate, settings: AdmissionSettings, workers: WorkerQueue | None
) -> dict[str, Any]:
    waiting = None
    if workers is not None:
        waiting = {"queued": workers.queued, "queued_by_priority": workers.queued_by_band()}
    return {
        "inflight": gate.inflight,
        "queued": gate.queued,
        "limit": settings.max_concurrent_requests or None,
        "max_queued": settings.max_queued_requests,
        "queue_timeout_s": settings.queue_timeout_s,
        "queued_by_priority": gate.queued_by_band,
        "worker_queue": waiting,
    }


def _worker(
    worker: Worker,
    index: KVBlockIndex,
    now: float,
    breakers: dict[tuple[str, str], dict[str, Any]],
) -> dict[str, Any]:
    breaker = breakers.get((worker.role.value, worker.public_url))
    return {
        "id": worker.id,
        "url": worker.public_url,
        "role": worker.role.value,
        "healthy": worker.healthy,
        "draining": worker.draining,
        "ejected": worker.ejected,
        "inflight": worker.host_inflight(),
        "dp_size": worker.dp_size,
        "models": sorted(worker.models),
        "adapters": sorted(worker.adapters),
        "full_retry_in_s": round(worker.full_until - now, 3) if worker.full_until > now else None,
        "circuit": None if breaker is None else {k: breaker[k] for k in _CIRCUIT_KEYS},
        "ranks": [_rank(worker, rank, index, now) for rank in range(len(worker.rank_inflight))],
    }


def _rank(worker: Worker, rank: int, index: KVBlockIndex, now: float) -> dict[str, Any]:
    readings = worker.engine_load
    view: dict[str, Any] = {
        "dp_rank": rank,
        "inflight": worker.rank_load(rank),
        "engine": _engine(readings[rank] if rank < len(readings) else None, now),
    }
    if worker.role is Role.PREFILL:
        view["pending_prefill_tokens"] = worker.pending_tokens(rank)
        view["kv_blocks"] = index.block_count((worker.id, rank))
    return view


def _engine(reading: LoadReading | None, now: float) -> dict[str, Any] | None:
    """The rank's engine-reported load, None when unknown (no reading, or a stale one)."""
    if reading is None or now >= reading.fresh_until:
        return None
    load = reading.load
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        "age_s": round(max(0.0, now - reading.at), 3),
    }


def _kv_events(prefills: list[Worker], feed: KVEventFeed) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for worker in prefills:
        for rank in range(worker.dp_size):
            stats = feed.stats((worker.id, rank))
            if stats is not None:
                rows.append({"worker": worker.public_url, "dp_rank": rank, **stats})
    return rows
