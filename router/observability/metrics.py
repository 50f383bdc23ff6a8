"""The router's own Prometheus metrics, one registry per app (no process-global state).

Per-request instruments live here (``RouterMetrics``); gauges of live state (workers, engine
loads, pairs, KV event feeds, the registry) are read at scrape time by
``router.observability.state_metrics.RouterStateCollector``, so workers that leave take their
series with them.
Its counters and histograms are ``router.observability.loop_metrics``' (plain numbers, no lock
per update; exposed as prometheus-client's own). Label children are cached: a request's
instruments cost a dict lookup each, not a ``labels()`` call.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from router.observability.loop_metrics import LoopCounter, LoopHistogram

__all__ = ["RouterMetrics"]

# Routing decisions take microseconds: buckets from 5 us to 50 ms.
_DECISION_BUCKETS = (
    5e-6, 10e-6, 20e-6, 35e-6, 50e-6, 75e-6, 100e-6, 150e-6, 200e-6, 300e-6, 500e-6,
    1e-3, 2e-3, 5e-3, 10e-3, 50e-3,
)  # fmt: skip
# Tokenizing a prompt: tens of microseconds (cached prefixes) to tens of milliseconds (a long
# uncached prompt, or a render call to an engine).
_TOKENIZE_BUCKETS = (
    20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3, 250e-3,
    1.0, 5.0,
)  # fmt: skip
# Request stages: a few milliseconds (a loopback fake) to minutes (long generations).
_STAGE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip

ROLES = ("prefill", "decode")
UPSTREAM_ERROR_KINDS = (
    "connect", "timeout", "kv_timeout", "kv_lost", "kv_failed", "http_4xx", "http_5xx",
    "capacity", "broken", "stale_connection", "worker_lost", "invalid_answer",
)  # fmt: skip
ADMISSION_REJECT_REASONS = (
    "queue_full", "queue_timeout", "worker_cap", "body_memory",
    "tenant_requests", "tenant_tokens", "tenant_concurrency", "shed", "deadline",
)  # fmt: skip
# the admission queue's priority bands (router.pipeline.admission_queue): < 0, 0, > 0
PRIORITY_BANDS = ("high", "normal", "low")


class RouterMetrics:
    """Counters and histograms the request path updates, served at ``GET /metrics``."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled  # off (the CPU ledger): the request path updates nothing
        self.registry = CollectorRegistry(auto_describe=True)
        self._declare_request_stages(self.registry)
        self._declare_routing(self.registry)
        self._declare_pools(self.registry)
        self._declare_admission(self.registry)
        self._start_known_labels()

    def _declare_request_stages(self, registry: CollectorRegistry) -> None:
        self.requests = LoopCounter(
            "pdr_requests",
            "Completion requests finished, by endpoint, final status (499: the client went "
            "away; a stream that failed after starting counts with the error's status) and "
            "stream",
            ["endpoint", "status", "stream"],
            registry=registry,
        )
        self.request_seconds = LoopHistogram(
            "pdr_request_duration_seconds",
            "Time from a completion request's arrival to the end of its response",
            ["endpoint", "stream"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )
        self.ttft_seconds = LoopHistogram(
            "pdr_ttft_seconds",
            "Streams: time from the request's arrival to the first byte sent to the client",
            ["endpoint"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )
        self.prefill_seconds = LoopHistogram(
            "pdr_prefill_duration_seconds",
            "The prefill leg: request sent to the prefill until its whole answer",
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )
        self.kv_wait_seconds = LoopHistogram(
            "pdr_kv_wait_seconds",
            "From the prefill's answer to the decode's first byte (the KV transfer, as the "
            "router sees it)",
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )

    def _declare_routing(self, registry: CollectorRegistry) -> None:
        self.retries = LoopCounter(
            "pdr_retries",
            "Attempts retried on another worker, by the role of the worker that failed",
            ["role"],
            registry=registry,
        )
        self.upstream_errors = LoopCounter(
            "pdr_upstream_errors",
            "Failed legs by role and kind (connect, timeout, kv_timeout, kv_lost, kv_failed: "
            "the decode said the prefill's KV did not arrive, http_4xx, http_5xx, capacity: "
            "429/503 from a full engine, broken, stale_connection, worker_lost, invalid_answer)",
            ["role", "kind"],
            registry=registry,
        )
        self.decision_seconds = LoopHistogram(
            "pdr_routing_decision_seconds",
            "Time to choose a prefill (and DP rank) and a decode for one request",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=registry,
        )
        self.circuit_transitions = LoopCounter(
            "pdr_circuit_transitions",
            "Circuit breaker transitions, by scope (worker; pair: a prefill->decode pair) and "
            "the state entered (open, half_open, closed)",
            ["scope", "to"],
            registry=registry,
        )
        self.outlier_ejections = LoopCounter(
            "pdr_outlier_ejections",
            "Workers ejected by outlier detection, by role and reason (overdue: its legs stopped "
            "completing; timeouts: its last legs timed out)",
            ["role", "reason"],
            registry=registry,
        )
        self.decisions = LoopCounter(
            "pdr_routing_decisions",
            "Requests routed, by prefill policy and outcome: how the prefill was chosen "
            "(cache_aware: precise, approximate, load; else the policy's name) or "
            "skipped_<reason> when the decode prefilled alone",
            ["policy", "outcome"],
            registry=registry,
        )
        self.session_pins = LoopCounter(
            "pdr_session_pins",
            "Routing choices of requests naming their session, by outcome (hit: the pin held; "
            "new; repinned; refused: a hard pin's worker unavailable, 503) and reason (why the "
            "pin yielded: gone, failed, unhealthy, draining, broken, busy, overloaded, policy)",
            ["outcome", "reason"],
            registry=registry,
        )
        self.tokenize_seconds = LoopHistogram(
            "pdr_tokenize_seconds",
            "Time to get one request's prompt token ids (local tokenizer or render API)",
            buckets=_TOKENIZE_BUCKETS,
            registry=registry,
        )

    def _declare_pools(self, registry: CollectorRegistry) -> None:
        """Model pools and tenants: labelled by configured or served names only."""
        self.routing_state_transitions = LoopCounter(
            "pdr_routing_state_transitions",
            "Routing state transitions, by scope (rank: a prefill DP rank; pool: a model's "
            "prefills) and the state entered (exact, degraded, fallback)",
            ["scope", "to"],
            registry=registry,
        )
        self.model_requests = LoopCounter(
            "pdr_model_requests",
            "Requests routed to a model's pool, by model: the served names (declared or read "
            "from the workers' /v1/models); `any` when no worker names a model or only workers "
            "naming none could take it",
            ["model"],
            registry=registry,
        )
        self.model_responses = LoopCounter(
            "pdr_model_responses",
            "Completion responses of a model's pool (only when the workers serve more than one "
            "model), by model (as pdr_model_requests) and HTTP status",
            ["model", "status"],
            registry=registry,
        )
        self.model_ttft_seconds = LoopHistogram(
            "pdr_model_ttft_seconds",
            "Time to the first byte of a streamed completion of a model's pool (only when the "
            "workers serve more than one model), by model",
            ["model"],
            registry=registry,
            buckets=_STAGE_BUCKETS,
        )
        self.tenant_requests = LoopCounter(
            "pdr_tenant_requests",
            "Requests authenticated with an API key (--api-keys), by tenant (the configured "
            "names only)",
            ["tenant"],
            registry=registry,
        )

    def _declare_admission(self, registry: CollectorRegistry) -> None:
        # read at scrape time from the admission gate (router.pipeline.admission binds them)
        self.requests_inflight = Gauge(
            "pdr_requests_inflight",
            "Completion requests admitted and not finished (each holds an admission slot)",
            registry=registry,
        )
        self.admission_queue_depth = Gauge(
            "pdr_admission_queue_depth",
            "Completion requests waiting for an admission slot",
            registry=registry,
        )
        self.admission_rejected = LoopCounter(
            "pdr_admission_rejected",
            "Requests answered 429 by admission control, by reason (queue_full, queue_timeout, "
            "worker_cap: every candidate worker at its in-flight cap; 503: shed for a more "
            "urgent request, deadline passed while queued)",
            ["reason"],
            registry=registry,
        )
        self.admission_queued = Gauge(
            "pdr_admission_queued",
            "Completion requests waiting for an admission slot, by priority band (high: "
            "priority < 0, normal: 0, low: > 0)",
            ["priority"],
            registry=registry,
        )
        self.admission_wait = LoopHistogram(
            "pdr_admission_wait_seconds",
            "Time requests that had to wait spent in the admission queue until admitted, by "
            "priority band",
            ["priority"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )

        self.worker_queue_depth = Gauge(
            "pdr_worker_queue_depth",
            "Admitted requests waiting for a worker below its in-flight cap "
            "(--queue-at-worker-caps)",
            registry=registry,
        )
        self.worker_queue_wait = LoopHistogram(
            "pdr_worker_queue_wait_seconds",
            "Time requests that had to wait spent waiting for a worker below its in-flight cap, "
            "by priority band",
            ["priority"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )

    def _start_known_labels(self) -> None:
        """Known label values start at 0: rate() sees the first failure, dashboards show 0."""
        for reason in ADMISSION_REJECT_REASONS:
            self.admission_rejected.labels(reason)
        for band in PRIORITY_BANDS:
            self.admission_wait.labels(band)
            self.worker_queue_wait.labels(band)
        for role in ROLES:
            self.retries.labels(role)
            for kind in UPSTREAM_ERROR_KINDS:
                self.upstream_errors.labels(role, kind)
            for reason in ("overdue", "timeouts"):
                self.outlier_ejections.labels(role, reason)
        for scope in ("worker", "pair"):
            for to in ("open", "half_open", "closed"):
                self.circuit_transitions.labels(scope, to)
        for scope in ("rank", "pool"):
            for to in ("exact", "degraded", "fallback"):
                self.routing_state_transitions.labels(scope, to)

    def count(self, metric: LoopCounter, *labels: str) -> None:
        if self.enabled:
            metric.child(labels).value += 1.0

    def observe(self, metric: LoopHistogram, value: float, *labels: str) -> None:
        if self.enabled:
            metric.child(labels).observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
