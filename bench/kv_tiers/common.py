"""What the tiered-KV benchmark's parts share (``bench.kv_tiers``): the pd-cluster command line
with the worker's ``--hicache-*`` flags, and the worker's tier counters.

The counters are the worker's own (``worker.hicache.metrics``):
``pd_worker_hicache_hit_tokens_total`` per ``tier`` (``GPU`` = L1, ``CPU_PINNED`` = L2, ``DISK`` =
L3), the L2 -> L1 loads, the L3 prefetches and backups, the corrupt pages, and the SGLang
prefix-cache counters (``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total``), summed
over the workers scraped. They are how every TTFT row is confirmed to have been served from the
tier it claims.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common.cluster import cluster_argv
from bench.common.prometheus import samples
from bench.common.prometheus import scrape as scrape_metrics

__all__ = [
    "GPU",
    "CPU_PINNED",
    "DISK",
    "TIERS",
    "TierCounters",
    "TierShape",
    "cluster_command",
    "hicache_flags",
    "parse_counters",
    "scrape",
    "settle",
]

GPU, CPU_PINNED, DISK = "GPU", "CPU_PINNED", "DISK"
TIERS = (GPU, CPU_PINNED, DISK)
_P = "pd_worker_hicache_"


@dataclass(frozen=True)
class TierShape:
    """The simulated model's KV shape and compute, as pd-worker flags."""

    layers: int = 8
    bytes_per_token: int = 4096  # per layer, K+V (pd-worker's default: 32 KiB per token)
    page_size: int = 16
    compute_s_per_token: float = 200e-6
    decode_s_per_token: float = 1e-3

    @property
    def token_bytes(self) -> int:
        return self.layers * self.bytes_per_token

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    def flags(self, pages: int) -> list[str]:
        return [
            "--layers",
            str(self.layers),
            "--bytes-per-token",
            str(self.bytes_per_token),
            "--page-size",
            str(self.page_size),
            "--pages",
            str(pages),
            "--compute-s-per-token",
            repr(self.compute_s_per_token),
            "--decode-s-per-token",
            repr(self.decode_s_per_token),
            "--log-level",
            "warning",
        ]


def hicache_flags(
    host_pages: int,
    *,
    storage_pages: int | None = None,
    prefetch_policy: str = "best_effort",
    layerwise: bool = True,
) -> list[str]:
    """pd-worker's tier flags: L2 of ``host_pages`` (0: no tiers at all) and, with
    ``storage_pages`` (0: unbounded), an L3 file store (its directory is pd-cluster's
    ``--hicache-storage-dir``)."""
    if host_pages <= 0:
        return []
    out = ["--hicache-host-pages", str(host_pages), "--hicache-prefetch-policy", prefetch_policy]
    out.append("--hicache-layerwise" if layerwise else "--no-hicache-layerwise")
    if storage_pages is not None:
        out += ["--hicache-storage-backend", "file", "--hicache-storage-pages", str(storage_pages)]
    return out


def cluster_command(
    *,
    prefills: int,
    decodes: int,
    port: int,
    ready_timeout_s: float,
    worker_flags: Sequence[str],
    storage_dir: Path | None = None,
    cluster_flags: Sequence[str] = (),
    router_flags: Sequence[str] = (),
) -> list[str]:
    """``python -m worker.cluster`` (SGLang protocol) with ``router_flags`` each passed as
    ``--router-arg=FLAG``, and ``worker_flags`` for every worker after ``--``."""
    router = ["--health-interval", "0.5", "--log-level", "warning", *router_flags]
    flags = [*(f"--router-arg={flag}" for flag in router), *cluster_flags]
    if storage_dir is not None:
        flags += ["--hicache-storage-dir", str(storage_dir)]
    return cluster_argv(
        prefills=prefills,
        decodes=decodes,
        port=port,
        engine="sglang",
        ready_timeout_s=ready_timeout_s,
        flags=flags,
        worker_args=worker_flags,
    )


# --- counters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierCounters:
    """The tier counters of one or more workers (summed); ``tiered``: they had tiers at all."""

    hits: dict[str, float] = field(default_factory=dict)  # tier -> prompt tokens served
    load_pages: float = 0.0  # L2 -> L1
    prefetch_pages: float = 0.0  # L3 -> L2
    backups: dict[str, float] = field(default_factory=dict)  # tier -> pages backed up into it
    corrupt_pages: float = 0.0
    cached_tokens: float = 0.0  # sglang:cached_tokens_total
    prompt_tokens: float = 0.0
    tiered: bool = False

    def __sub__(self, before: TierCounters) -> TierCounters:
        return TierCounters(
            hits=_minus(self.hits, before.hits),
            load_pages=self.load_pages - before.load_pages,
            prefetch_pages=self.prefetch_pages - before.prefetch_pages,
            backups=_minus(self.backups, before.backups),
            corrupt_pages=self.corrupt_pages - before.corrupt_pages,
            cached_tokens=self.cached_tokens - before.cached_tokens,
            prompt_tokens=self.prompt_tokens - before.prompt_tokens,
            tiered=self.tiered,
        )

    def __add__(self, other: TierCounters) -> TierCounters:
        return TierCounters(
            hits=_plus(self.hits, other.hits),
            load_pages=self.load_pages + other.load_pages,
            prefetch_pages=self.prefetch_pages + other.prefetch_pages,
            backups=_plus(self.backups, other.backups),
            corrupt_pages=self.corrupt_pages + other.corrupt_pages,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            tiered=self.tiered or other.tiered,
        )

    def hit(self, tier: str) -> float:
        return self.hits.get(tier, 0.0)


def _minus(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in {*after, *before}}


def _plus(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in {*a, *b}}


def parse_counters(text: str) -> TierCounters:
    """One worker's ``/metrics`` exposition as ``TierCounters``."""
    hits: dict[str, float] = {}
    backups: dict[str, float] = {}
    totals: dict[str, float] = {}
    tiered = False
    for name, labels, value in samples(text):
        tiered = tiered or name.startswith(_P)
        if name == f"{_P}hit_tokens_total":
            tier = labels.get("tier", "")
            hits[tier] = hits.get(tier, 0.0) + value
        elif name == f"{_P}backup_pages_total":
            tier = labels.get("tier", "")
            backups[tier] = backups.get(tier, 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + value
    return TierCounters(
        hits=hits,
        load_pages=totals.get(f"{_P}load_pages_total", 0.0),
        prefetch_pages=totals.get(f"{_P}prefetch_pages_total", 0.0),
        backups=backups,
        corrupt_pages=totals.get(f"{_P}corrupt_pages_total", 0.0),
        cached_tokens=totals.get("sglang:cached_tokens_total", 0.0),
        prompt_tokens=totals.get("sglang:prompt_tokens_total", 0.0),
        tiered=tiered,
    )


def scrape(client: httpx.Client, urls: Sequence[str]) -> TierCounters:
    """The workers' counters, summed; ``BenchError`` when one does not answer."""
    total = TierCounters()
    for url in urls:
        total = total + parse_counters(scrape_metrics(client, url))
    return total


def settle(
    client: httpx.Client, urls: Sequence[str], quiet_s: float = 0.5, limit_s: float = 30.0
) -> TierCounters:
    """Wait until the workers' backups stop moving (no L2/L3 backup landed for ``quiet_s``;
    at most ``limit_s``): the L1 -> L2 copies and the L3 writer run behind the requests and
    would slow the next one down. The last counters."""
    deadline = time.monotonic() + limit_s
    last = scrape(client, urls)
    changed = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = scrape(client, urls)
        if now.backups != last.backups:
            changed = time.monotonic()
        elif time.monotonic() - changed >= quiet_s:
            return now
        last = now
    return last
