"""``/metrics`` of the tiered KV cache (``worker.hicache.controller``), registered only when a tier
is configured (``--hicache-host-pages`` > 0), in the worker's own ``CollectorRegistry``.

docs/concepts/protocols.md names no SGLang HiCache metrics, so these carry our own prefix,
``pd_worker_hicache_``. Labels: ``model_name``, the rank label of the worker's protocol
(``engine`` for vLLM, ``dp_rank`` for SGLang, as ``worker.metrics``) and, where it applies,
``tier``: the KV event medium, ``GPU`` (L1), ``CPU_PINNED`` (L2) or ``DISK`` (L3).

* ``pd_worker_hicache_hit_tokens_total{tier}``: prompt tokens served from that tier (counted
  when the request starts its forward pass, after the late-prefetch policy and integrity checks);
  ``pd_worker_hicache_miss_tokens_total{tier}``: prompt tokens that tier was asked for and did
  not serve (GPU: the prompt beyond its L1 hit; CPU_PINNED: that beyond the L2 hit; DISK: that
  beyond the L3 hit, i.e. computed; only with an L3);
* ``pd_worker_hicache_load_pages_total`` / ``…_load_bytes_total``: pages copied L2 -> L1;
  ``pd_worker_hicache_prefetch_pages_total`` / ``…_prefetch_bytes_total``: pages read L3 -> L2;
  ``pd_worker_hicache_backup_pages_total{tier}`` / ``…_backup_bytes_total{tier}``: pages backed
  up into ``tier`` (CPU_PINNED: from L1, DISK: from L2);
* histograms ``pd_worker_hicache_load_seconds`` (one request's L2 -> L1 load, modelled link
  time included), ``pd_worker_hicache_prefetch_seconds`` (one request's L3 prefetch),
  ``pd_worker_hicache_backup_seconds{tier}`` (one batch of backups);
* ``pd_worker_hicache_corrupt_pages_total{tier}``: pages that failed their integrity check when
  read back (dropped, their prefix recomputed);
* gauge ``pd_worker_hicache_pages{tier}``: pages held in L2 and in L3 (L3: the in-memory index).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RankTierMetrics", "TierMetrics"]

_PREFIX = "pd_worker_hicache_"
_SECONDS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class TierMetrics:
    """The tier metric families of one worker; ``rank(i)`` binds the labels of rank ``i``."""

    def __init__(self, registry: CollectorRegistry, model: str, rank_label: str) -> None:
        self._model = model
        labels = ["model_name", rank_label]
        tiered = [*labels, "tier"]

        def counter(name: str, doc: str, names: list[str]) -> Counter:
            return Counter(_PREFIX + name, doc, names, registry=registry)

        def histogram(name: str, doc: str, names: list[str]) -> Histogram:
            return Histogram(_PREFIX + name, doc, names, buckets=_SECONDS, registry=registry)

        self.hits = counter("hit_tokens", "Prompt tokens served from a cache tier.", tiered)
        self.misses = counter("miss_tokens", "Prompt tokens a tier did not serve.", tiered)
        self.load_pages = counter("load_pages", "Pages loaded from host memory (L2).", labels)
        self.load_bytes = counter("load_bytes", "Bytes loaded from host memory (L2).", labels)
        self.prefetch_pages = counter("prefetch_pages", "Pages prefetched from L3.", labels)
        self.prefetch_bytes = counter("prefetch_bytes", "Bytes prefetched from L3.", labels)
        self.backup_pages = counter("backup_pages", "Pages backed up into a tier.", tiered)
        self.backup_bytes = counter("backup_bytes", "Bytes backed up into a tier.", tiered)
        self.corrupt = counter("corrupt_pages", "Pages that failed their check.", tiered)
        self.load_s = histogram("load_seconds", "L2 -> L1 load time per request.", labels)
        self.prefetch_s = histogram("prefetch_seconds", "L3 prefetch time per request.", labels)
        self.backup_s = histogram("backup_seconds", "Backup time per batch.", tiered)
        self.pages = Gauge(_PREFIX + "pages", "Pages held in a tier.", tiered, registry=registry)

    def rank(self, index: int) -> RankTierMetrics:
        return RankTierMetrics(self, [self._model, str(index)])


class RankTierMetrics:
    """One rank's view of ``TierMetrics``."""

    def __init__(self, families: TierMetrics, labels: list[str]) -> None:
        self._f = families
        self._labels = labels

    def served(self, tier: str, hit: int, miss: int) -> None:
        self._f.hits.labels(*self._labels, tier).inc(hit)
        self._f.misses.labels(*self._labels, tier).inc(miss)

    def loaded(self, pages: int, nbytes: int, seconds: float) -> None:
        self._f.load_pages.labels(*self._labels).inc(pages)
        self._f.load_bytes.labels(*self._labels).inc(nbytes)
        self._f.load_s.labels(*self._labels).observe(seconds)

    def prefetched(self, pages: int, nbytes: int, seconds: float) -> None:
        self._f.prefetch_pages.labels(*self._labels).inc(pages)
        self._f.prefetch_bytes.labels(*self._labels).inc(nbytes)
        self._f.prefetch_s.labels(*self._labels).observe(seconds)

    def backed_up(self, tier: str, pages: int, nbytes: int, seconds: float) -> None:
        self._f.backup_pages.labels(*self._labels, tier).inc(pages)
        self._f.backup_bytes.labels(*self._labels, tier).inc(nbytes)
        self._f.backup_s.labels(*self._labels, tier).observe(seconds)

    def corrupt(self, tier: str) -> None:
        self._f.corrupt.labels(*self._labels, tier).inc()

    def held(self, tier: str, count: Callable[[], float]) -> None:
        """Report ``count()`` as the pages held in ``tier`` at every scrape."""
        self._f.pages.labels(*self._labels, tier).set_function(count)
