"""``GET /metrics``: the engine's load and prefix-cache signals under the real engines' names.

One ``CollectorRegistry`` per worker (no global registry). Gauges and counters are read from
``RankSnapshot``s at scrape time; the time-to-first-token histogram is observed as requests get
their first token. One series per DP rank. Names and meanings (docs/concepts/protocols.md 11.1):

vLLM (``vllm-mooncake``), labels ``model_name`` and ``engine`` (the DP rank as a string):
  ``vllm:num_requests_running`` (in the forward pass or decoding), ``vllm:num_requests_waiting``
  (queued for KV pages or the forward pass, plus a decode's requests waiting for pages or for
  their KV, as vLLM counts ``WAITING_FOR_REMOTE_KVS``), ``vllm:kv_cache_usage_perc``
  (pages referenced by requests / all pages, 0..1: cached pages nobody references are free, as in
  vLLM), counters ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt
  tokens looked up in the prefix cache / served from it), ``vllm:prompt_tokens_by_source_total``
  (``source`` = ``local_compute``, ``local_cache_hit``, ``external_kv_transfer``) and the
  histogram ``vllm:time_to_first_token_seconds``, the info gauge ``vllm:cache_config_info``
  (``block_size``).

SGLang (``sglang``), labels ``model_name`` and ``dp_rank``: ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs`` (the waiting queue: for KV pages or the forward pass),
  ``sglang:token_usage`` (0..1, as above), ``sglang:cache_hit_rate`` (cached / prompt tokens
  since start, 0..1), counters ``sglang:prompt_tokens_total`` and
  ``sglang:cached_tokens_total``, the PD queues ``sglang:num_prefill_prealloc_queue_reqs``
  (waiting for the decode's transfer info), ``sglang:num_prefill_inflight_queue_reqs`` (KV being
  sent), ``sglang:num_decode_prealloc_queue_reqs`` (waiting for pages to receive into),
  ``sglang:num_decode_transfer_queue_reqs`` (waiting for KV), and the histogram
  ``sglang:time_to_first_token_seconds``.

Prompt and cache counts cover the requests that consult the prefix cache: a prefill's, and
those computed locally (``--role both``, a vLLM decode without ``kv_transfer_params``). With a
tiered cache, cached tokens include those served from L2/L3, and the tier metrics of
``worker.hicache.metrics`` (``pd_worker_hicache_*``) join the same registry (``tiers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.hicache.metrics import TierMetrics

__all__ = ["CONTENT_TYPE", "RankSnapshot", "WorkerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's TTFT buckets (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RankSnapshot:
    """One DP rank's load and cache counters at one moment."""

    rank: int
    running: int  # in the forward pass, or decoding/streaming
    waiting: int  # queued for pages or the forward pass (prefill, local compute)
    receiving: int  # decode: waiting for its KV from a prefill
    prealloc: int  # decode: waiting for pages and an aux slot to receive into
    bootstrap: int  # prefill: waiting for the decode's transfer info
    inflight: int  # prefill: KV computed, being sent
    used_pages: int
    total_pages: int
    page_size: int
    pool_bytes: int
    waiting_tokens: int  # prompt tokens of requests not yet computed
    query_tokens: int  # prompt tokens looked up in the prefix cache
    hit_tokens: int  # of those, served from the cache
    computed_tokens: int  # prompt tokens computed here
    received_tokens: int  # prompt tokens whose KV came from a prefill

    @property
    def usage(self) -> float:
        return self.used_pages / self.total_pages if self.total_pages else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class WorkerMetrics:
    """The worker's registry: ``observe_ttft`` per request, ``exposition()`` per scrape;
    ``tiers``: the tiered cache's families (with ``tiers=True``)."""

    def __init__(
        self,
        protocol: str,
        model: str,
        snapshots: Callable[[], Sequence[RankSnapshot]],
        *,
        tiers: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._vllm = protocol != "sglang"
        self._model = model
        prefix, rank_label = ("vllm", "engine") if self._vllm else ("sglang", "dp_rank")
        self._ttft = Histogram(
            f"{prefix}:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ["model_name", rank_label],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_RankCollector(model, snapshots, self._vllm))
        self.tiers = TierMetrics(self.registry, model, rank_label) if tiers else None

    def observe_ttft(self, rank: int, seconds: float) -> None:
        self._ttft.labels(self._model, str(rank)).observe(seconds)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


_Value = Callable[[RankSnapshot], float]
_Row = tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, _Value]

_VLLM: list[_Row] = [
    (GaugeMetricFamily, "vllm:num_requests_running",
     "Number of requests in model execution batches.", lambda s: s.running),
    (GaugeMetricFamily, "vllm:num_requests_waiting",
     "Number of requests waiting to be processed.",
     lambda s: s.waiting + s.prealloc + s.receiving),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc",
     "KV-cache usage. 1 means 100 percent usage.", lambda s: s.usage),
    (CounterMetricFamily, "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.", lambda s: s.query_tokens),
    (CounterMetricFamily, "vllm:prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens.", lambda s: s.hit_tokens),
]  # fmt: skip

_SGLANG: list[_Row] = [
    (GaugeMetricFamily, "sglang:num_running_reqs",
     "The number of running requests.", lambda s: s.running),
    (GaugeMetricFamily, "sglang:num_queue_reqs",
     "The number of requests in the waiting queue.", lambda s: s.waiting),
    (GaugeMetricFamily, "sglang:token_usage", "The token usage.", lambda s: s.usage),
    (GaugeMetricFamily, "sglang:cache_hit_rate",
     "The prefix cache hit rate.", lambda s: s.hit_rate),
    (GaugeMetricFamily, "sglang:num_prefill_prealloc_queue_reqs",
     "The number of requests in the prefill prealloc queue.", lambda s: s.bootstrap),
    (GaugeMetricFamily, "sglang:num_prefill_inflight_queue_reqs",
     "The number of requests in the prefill inflight queue.", lambda s: s.inflight),
    (GaugeMetricFamily, "sglang:num_decode_prealloc_queue_reqs",
     "The number of requests in the decode prealloc queue.", lambda s: s.prealloc),
    (GaugeMetricFamily, "sglang:num_decode_transfer_queue_reqs",
     "The number of requests in the decode transfer queue.", lambda s: s.receiving),
    (CounterMetricFamily, "sglang:prompt_tokens",
     "Number of prefill tokens processed.", lambda s: s.query_tokens),
    (CounterMetricFamily, "sglang:cached_tokens",
     "Number of cached prompt tokens.", lambda s: s.hit_tokens),
]  # fmt: skip

_SOURCES: list[tuple[str, _Value]] = [
    ("local_compute", lambda s: s.computed_tokens),
    ("local_cache_hit", lambda s: s.hit_tokens),
    ("external_kv_transfer", lambda s: s.received_tokens),
]


class _RankCollector(Collector):
    """Yields one family per table row, with one sample per DP rank."""

    def __init__(
        self, model: str, snapshots: Callable[[], Sequence[RankSnapshot]], vllm: bool
    ) -> None:
        self._model = model
        self._snapshots = snapshots
        self._vllm = vllm
        self._rank_label = "engine" if vllm else "dp_rank"

    def collect(self) -> Iterator[Metric]:
        snaps = list(self._snapshots())
        labels = ["model_name", self._rank_label]
        for kind, name, doc, value in _VLLM if self._vllm else _SGLANG:
            family = kind(name, doc, labels=labels)
            for snap in snaps:
                family.add_metric([self._model, str(snap.rank)], value(snap))
            yield family
        if self._vllm:
            yield self._by_source(snaps)
            yield self._cache_config(snaps)

    def _cache_config(self, snaps: Sequence[RankSnapshot]) -> Metric:
        """vLLM's info gauge of its CacheConfig: the block size, per engine."""
        family = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine"],
        )
        for snap in snaps:
            family.add_metric([str(snap.page_size), "True", str(snap.rank)], 1.0)
        return family

    def _by_source(self, snaps: Sequence[RankSnapshot]) -> Metric:
        family = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=["model_name", self._rank_label, "source"],
        )
        for snap in snaps:
            for source, value in _SOURCES:
                family.add_metric([self._model, str(snap.rank), source], value(snap))
        return family
