"""What the tiered-KV benchmark's parts share (``bench.kv_tiers.main``): the pd-cluster command line
with the worker's ``--hicache-*`` flags, a started cluster, and the worker's tier counters.

The counters are the worker's own (``worker.hicache.metrics``):
``pd_worker_hicache_hit_tokens_total``
per ``tier`` (``GPU`` = L1, ``CPU_PINNED`` = L2, ``DISK`` = L3), the L2 -> L1 loads, the L3
prefetches and backups, the corrupt pages, and the SGLang prefix-cache counters
(``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total``), summed over the workers
scraped. They are how every TTFT row is confirmed to have been served from the tier it claims.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.load.cluster_ttft import BenchError, Child, wait_health
from bench.routing.workload import Cluster, router_pid

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
    "started",
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
    argv = [
        sys.executable,
        "-m",
        "worker.cluster",
        "--prefill",
        str(prefills),
        "--decode",
        str(decodes),
        "--port",
        str(port),
        "--engine",
        "sglang",
        "--ready-timeout",
        str(ready_timeout_s),
        *(f"--router-arg={flag}" for flag in router),
        *cluster_flags,
    ]
    if storage_dir is not None:
        argv += ["--hicache-storage-dir", str(storage_dir)]
    return [*argv, "--", *worker_flags]


def _layout(url: str) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], str]:
    with httpx.Client(timeout=5.0) as client:
        ready = client.get(f"{url}/ready").raise_for_status().json()
        models = client.get(f"{url}/v1/models").raise_for_status().json()
    prefills = tuple((str(w["url"]), int(w["bootstrap_port"])) for w in ready["prefill"])
    return prefills, tuple(str(w["url"]) for w in ready["decode"]), str(models["data"][0]["id"])


@contextlib.contextmanager
def started(argv: list[str], ready_timeout_s: float) -> Iterator[Cluster]:
    """pd-cluster started from ``argv``, serving; its whole process tree stopped on the way out
    (SIGTERM to its group, SIGKILL after a grace period, then whatever it left)."""
    child = Child(argv)
    try:
        url = child.wait_ready_line(ready_timeout_s + 10.0)
        child.note_descendants()
        try:
            prefills, decodes, model = _layout(url)
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise BenchError(child.describe(f"no worker layout from /ready: {exc}")) from exc
        for worker in [*(prefill for prefill, _port in prefills), *decodes]:
            wait_health(child, worker, ready_timeout_s)  # /ready needs one of each, not all
        yield Cluster(child, url, prefills, decodes, model, router_pid(child.proc.pid))
    finally:
        child.stop()


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
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            tiered = tiered or name.startswith(_P)
            if name == f"{_P}hit_tokens_total":
                tier = sample.labels.get("tier", "")
                hits[tier] = hits.get(tier, 0.0) + value
            elif name == f"{_P}backup_pages_total":
                tier = sample.labels.get("tier", "")
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
        try:
            response = client.get(f"{url}/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise BenchError(f"{url}/metrics: {exc}") from exc
        total = total + parse_counters(response.text)
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
