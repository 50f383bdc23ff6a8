"""Part 2 of ``bench.kv_tiers``: the multi-turn chat trace (``bench.routing.traces.multi_turn``,
as ``bench.routing.workload`` runs it) through ``pd-cluster`` with device pools far below the
working set, once without tiers and once with L2 host memory and an L3 file store.

Both runs: a fresh cluster of 2 prefills and 1 decode, SGLang protocol, the router's
``cache_aware`` prefill policy with the engines' tokenizer (so it follows their KV events, tier
``medium`` included, and scores L2/L3 blocks with ``--cache-tier-weights``: the weights part 1
derived when it did, the router's defaults otherwise), ``least_load`` decode; the same trace
replayed by ``bench.routing.workload.drive`` (``concurrency`` sessions at a time, streaming).

``--pages`` per worker: a sixteenth of the trace's distinct prefix pages, but never fewer than
``concurrency`` of its longest prompts (a prefill fails a request it has no pages for). The
tiered run adds ``host_ratio`` x that in L2 (write-through: L2 holds what L1 holds, so only
its excess serves) and an unbounded L3 in a temporary directory, prefetched under the
``timeout`` policy (``best_effort`` would only use what arrives while a request waits for its
forward pass, next to nothing in an uncongested prefill).
Reported: TTFT p50/p99, req/s, the engines' prefix-hit ratio and each tier's hit tokens (the
prefills' ``pd_worker_hicache_hit_tokens_total``; without tiers, the SGLang cached tokens are
all L1), and tiered / untiered ratios.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from bench.common.cluster import Cluster, started_cluster
from bench.common.process import BenchError, free_port
from bench.kv_tiers.common import (
    DISK,
    GPU,
    TierCounters,
    TierShape,
    cluster_command,
    hicache_flags,
    scrape,
)
from bench.routing.traces import Trace, multi_turn
from bench.routing.workload import (
    POOLED,
    BenchSetup,
    RunResult,
    WorkloadConfig,
    drive,
    prepare,
    summarize,
    take_snapshot,
)

__all__ = ["TierWorkloadConfig", "WorkloadResult", "WorkloadRun", "pages_for", "run_workload"]


@dataclass(frozen=True)
class TierWorkloadConfig:
    quick: bool = False
    # a lighter KV than part 1 (8 KiB per token): every request moves its whole prompt's KV to
    # the decode, which the 2-core machine must afford for ~200 requests
    shape: TierShape = field(default_factory=lambda: TierShape(bytes_per_token=1024))
    prefills: int = 2
    decodes: int = 1
    # few sessions at a time: a prefill needs pages for all its concurrent prompts, which would
    # otherwise set the device pool's floor (and keep every active conversation in it)
    concurrency: int = 2
    device_fraction: float = 1 / 16  # of the working set's pages, per worker
    # L2 pages per L1 page: with write-through L2 holds what L1 holds, so only the excess
    # serves; SGLang's default 2 would keep the trace's reuse within L1 + L2 and leave L3 idle
    host_ratio: float = 1.5
    prefetch_policy: str = "timeout"  # with its default 1 s
    run_deadline_s: float = 150.0
    request_timeout_s: float = 60.0
    ready_timeout_s: float = 60.0
    seed: int = 0


@dataclass(frozen=True)
class WorkloadRun:
    label: str
    pages: int
    host_pages: int
    result: RunResult
    tier_hits: dict[str, float]  # tier -> hit tokens over the run (all prefills)
    prompt_tokens: float
    errors: tuple[str, ...] = ()
    l3_written_mib: float = 0.0  # pages backed up into L3 (each hashed and written)
    l3_read_mib: float = 0.0  # pages prefetched from L3


@dataclass(frozen=True)
class WorkloadResult:
    config: TierWorkloadConfig
    trace: str
    requests: int
    working_set_pages: int
    runs: tuple[WorkloadRun, ...]
    router_weights: str | None  # the --cache-tier-weights given, None: the router's defaults
    wall_s: float


def trace_for(cfg: TierWorkloadConfig, chars_per_token: float) -> Trace:
    """``bench.routing.traces``' multi-turn trace, as ``standard_traces`` builds it (quick:
    smaller)."""
    if cfg.quick:
        return multi_turn(
            conversations=12,
            turns=3,
            groups=6,
            chars_per_token=chars_per_token,
            concurrency=cfg.concurrency,
            seed=cfg.seed,
        )
    return multi_turn(chars_per_token=chars_per_token, concurrency=cfg.concurrency, seed=cfg.seed)


def pages_for(cfg: TierWorkloadConfig, trace: Trace, chars_per_token: float) -> tuple[int, int]:
    """(``--pages`` per worker, the working set in pages)."""
    page = cfg.shape.page_size
    working = math.ceil(trace.working_set_chars() / chars_per_token / page)
    # chars per token is an average: the longest prompt gets a margin (and the chat template)
    longest = math.ceil(trace.max_prompt_chars() / chars_per_token / page * 1.1) + 4
    return max(math.ceil(working * cfg.device_fraction), cfg.concurrency * longest), working


def _argv(
    cfg: TierWorkloadConfig,
    setup: BenchSetup,
    pages: int,
    host_pages: int,
    root: Path | None,
    weights: str | None,
) -> list[str]:
    router = ["--cache-tier-weights", weights] if weights else []
    workers = [
        *cfg.shape.flags(pages),
        "--tokenizer",
        str(setup.tokenizer_dir),
        *hicache_flags(
            host_pages,
            storage_pages=0 if root is not None else None,
            prefetch_policy=cfg.prefetch_policy,
        ),
    ]
    return cluster_command(
        prefills=cfg.prefills,
        decodes=cfg.decodes,
        port=free_port(),
        ready_timeout_s=cfg.ready_timeout_s,
        worker_flags=workers,
        storage_dir=root,
        cluster_flags=[
            "--prefill-policy",
            "cache_aware",
            "--decode-policy",
            "least_load",
            "--tokenizer",
            str(setup.tokenizer_dir),
        ],
        router_flags=router,
    )


def _scrape(cluster: Cluster, http: httpx.Client, urls: list[str]) -> TierCounters:
    try:
        return scrape(http, urls)
    except BenchError as exc:  # with the cluster's last output: why the worker is gone
        raise BenchError(cluster.child.describe(str(exc))) from exc


def _run(
    cfg: TierWorkloadConfig,
    setup: BenchSetup,
    trace: Trace,
    label: str,
    sizes: tuple[int, int],
    weights: str | None,
) -> WorkloadRun:
    pages, host_pages = sizes
    base = RunResult(trace.name, label, "ours", POOLED, pages, trace.requests)
    load = WorkloadConfig(
        quick=cfg.quick,
        prefills=cfg.prefills,
        decodes=cfg.decodes,
        concurrency=cfg.concurrency,
        run_deadline_s=cfg.run_deadline_s,
        request_timeout_s=cfg.request_timeout_s,
        seed=cfg.seed,
    )
    with tempfile.TemporaryDirectory(prefix="kv-tiers-workload-") as tmp:
        root = Path(tmp) if host_pages else None
        argv = _argv(cfg, setup, pages, host_pages, root, weights)
        try:
            with (
                started_cluster(argv, cfg.ready_timeout_s, every_worker=True) as cluster,
                httpx.Client(timeout=5.0) as http,
            ):
                prefills = [url for url, _port in cluster.prefills]
                tiers_before = _scrape(cluster, http, prefills)
                before = take_snapshot(http, prefills, cluster.url, cluster.router_pids)
                outcomes, wall_s = asyncio.run(
                    drive(trace, cluster.url, cluster.model, POOLED, load)
                )
                after = take_snapshot(http, prefills, cluster.url, cluster.router_pids, after=True)
                delta: TierCounters = _scrape(cluster, http, prefills) - tiers_before
        except BenchError as exc:
            failed = replace(base, not_run=f"failed: {exc}", failed=True)
            return WorkloadRun(label, pages, host_pages, failed, {}, 0.0, (str(exc),))
    result = summarize(base, outcomes, wall_s, before, after)
    hits = dict(delta.hits) if delta.tiered else {GPU: delta.cached_tokens}
    page_mib = cfg.shape.page_bytes / (1 << 20)
    return WorkloadRun(
        label,
        pages,
        host_pages,
        result,
        hits,
        delta.prompt_tokens,
        result.error_samples,
        delta.backups.get(DISK, 0.0) * page_mib,
        delta.prefetch_pages * page_mib,
    )


def run_workload(
    cfg: TierWorkloadConfig, weights: dict[str, float] | None = None
) -> WorkloadResult:
    """Without tiers, then with L2 + L3; each on a fresh cluster."""
    began = time.monotonic()
    flag = ",".join(f"{tier}={value:.2f}" for tier, value in weights.items()) if weights else None
    with tempfile.TemporaryDirectory(prefix="kv-tiers-tok-") as tmp:
        setup = prepare(Path(tmp))
        trace = trace_for(cfg, setup.chars_per_token)
        pages, working = pages_for(cfg, trace, setup.chars_per_token)
        host = max(1, math.ceil(pages * cfg.host_ratio))
        runs = (
            _run(cfg, setup, trace, "no tiers", (pages, 0), flag),
            _run(cfg, setup, trace, "L2+L3", (pages, host), flag),
        )
    return WorkloadResult(
        cfg, trace.description, trace.requests, working, runs, flag, time.monotonic() - began
    )
