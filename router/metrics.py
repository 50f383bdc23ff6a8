"""The router's own Prometheus metrics, one registry per app (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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


class RouterMetrics:
    """Counters and histograms the pipeline and policies update, served at ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decision_seconds = Histogram(
            "pdr_routing_decision_seconds",
            "Time to choose a prefill (and DP rank) and a decode for one request",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=self.registry,
        )
        self.tokenize_seconds = Histogram(
            "pdr_tokenize_seconds",
            "Time to get one request's prompt token ids (local tokenizer or render API)",
            buckets=_TOKENIZE_BUCKETS,
            registry=self.registry,
        )
        self.prefill_skipped = Counter(
            "pdr_prefill_skipped",
            "Requests sent to a decode alone (it prefills locally), by reason",
            ["reason"],
            registry=self.registry,
        )
        self.routed = Counter(
            "pdr_routed_requests",
            "Requests routed, by how the prefill was chosen",
            ["prefill_choice"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
