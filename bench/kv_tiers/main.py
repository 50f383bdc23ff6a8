"""The tiered KV cache (pd-worker ``--hicache-*``) measured: tier TTFT, a workload, storage speed.

    python -m bench.kv_tiers [--quick] [--json PATH] [--parts ttft,workload,storage]

Three parts, printed in order (their modules' docstrings say exactly what each does):

1. ``bench.kv_tiers.ttft``: TTFT p50 of a long repeated prefix served from L1, L2, L3 and
   recomputed, through ``pd-cluster`` 1P1D and the router, every sample confirmed by the
   prefill's own ``pd_worker_hicache_hit_tokens_total{tier}``; L2/L3 with layer-by-layer
   loading on and off; each tier's ratio to recompute, and the router tier weights they imply,
   ``weight = 1 - (TTFT_tier - TTFT_L1) / (TTFT_recompute - TTFT_L1)`` (paired per repeat),
   clipped to [0, 1], printed as ``--cache-tier-weights``;
2. ``bench.kv_tiers.workload``: the multi-turn chat trace through ``pd-cluster`` 2P1D
   (``cache_aware`` prefill routing, given part 1's weights) with device pools far below the
   working set, without tiers and with L2 + L3: TTFT p50/p99, req/s, hit tokens per tier;
3. ``bench.kv_tiers.storage``: the directory store's prefetch throughput against the disk's
   raw sequential read (target >= 70%), cold and warm, and the checksum's share.

``bench.kv_tiers.common`` (the pd-cluster command line, the counters), ``bench.kv_tiers.rows``
(the TTFT rows, their confirmation, the weights) and ``bench.kv_tiers.report`` (the tables) are
shared pieces.

Every run is bounded (repeats, a deadline for part 1, per-request timeouts, a load deadline)
and every child is stopped (SIGTERM to its process group, SIGKILL after a grace period, then
whatever it left). Performance is measured, not asserted: the exit status is 1 only when a part
could not run, a request failed or a TTFT sample was not served from the tier it claims.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common.cli import exit_on_failure, finish, sigterm_raises, write_json
from bench.kv_tiers.common import TierShape
from bench.kv_tiers.report import render_storage, render_ttft, render_workload
from bench.kv_tiers.storage import StorageConfig, StorageResult, run_storage
from bench.kv_tiers.ttft import TierTTFTConfig, TierTTFTResult, run_tier_ttft
from bench.kv_tiers.workload import TierWorkloadConfig, WorkloadResult, run_workload

__all__ = [
    "PARTS",
    "Config",
    "Report",
    "failed",
    "main",
    "parse_args",
    "render",
    "run_all",
    "write_json",
]

PARTS = ("ttft", "workload", "storage")


@dataclass(frozen=True)
class Config:
    ttft: TierTTFTConfig
    workload: TierWorkloadConfig
    storage: StorageConfig
    quick: bool = False
    parts: tuple[str, ...] = PARTS
    json_path: Path | None = None


@dataclass(frozen=True)
class Report:
    quick: bool
    ttft: TierTTFTResult | None
    workload: WorkloadResult | None
    storage: StorageResult | None
    wall_s: float


def run_all(cfg: Config) -> Report:
    """The selected parts in order; children stopped whatever happens (SIGTERM raises
    ``KeyboardInterrupt`` here, so every ``finally`` runs)."""
    began = time.monotonic()
    ttft = workload = storage = None
    with sigterm_raises():
        if "ttft" in cfg.parts:
            ttft = run_tier_ttft(cfg.ttft)
            _progress(f"tier TTFT done ({time.monotonic() - began:.0f} s)")
        if "workload" in cfg.parts:
            workload = run_workload(cfg.workload, ttft.weights if ttft else None)
            _progress(f"workload done ({time.monotonic() - began:.0f} s)")
        if "storage" in cfg.parts:
            storage = run_storage(cfg.storage)
    return Report(cfg.quick, ttft, workload, storage, time.monotonic() - began)


def _progress(line: str) -> None:
    print(f"kv_tiers: {line}", file=sys.stderr, flush=True)


def render(report: Report) -> str:
    lines = [f"kv_tiers{' --quick' if report.quick else ''}: {report.wall_s:.0f} s in all", ""]
    if report.ttft is not None:
        lines += [*render_ttft(report.ttft), ""]
    if report.workload is not None:
        lines += [*render_workload(report.workload), ""]
    if report.storage is not None:
        lines += render_storage(report.storage)
    return "\n".join(lines).rstrip()


def failed(report: Report) -> bool:
    """A part could not run, a request failed, or a TTFT sample was not confirmed."""
    bad = False
    if report.ttft is not None:
        rows = report.ttft.rows
        bad |= bool(report.ttft.failures) or any(r.errors or not r.samples for r in rows)
        bad |= any(row.confirmed < len(row.samples) for row in rows)
    if report.workload is not None:
        bad |= any(run.result.failed or run.result.errors for run in report.workload.runs)
    return bad


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        prog="bench.kv_tiers", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--parts", default=",".join(PARTS), help="subset of: " + ", ".join(PARTS))
    parser.add_argument("--repeats", type=int, help="part 1 repeats (default 5, --quick 2)")
    parser.add_argument("--prefix-tokens", type=int, help="part 1 (default 4096, --quick 1024)")
    parser.add_argument("--compute-s-per-token", type=float, default=TierShape.compute_s_per_token)
    parser.add_argument("--storage-mib", type=int, help="part 3 total (default 1024, quick 64)")
    parser.add_argument("--storage-dir", type=Path, help="part 3 directory (default: $TMPDIR)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    if set(parts) - set(PARTS):
        parser.error(f"unknown part: {', '.join(sorted(set(parts) - set(PARTS)))}")
    quick = bool(args.quick)
    compute = args.compute_s_per_token
    ttft = TierTTFTConfig(
        shape=TierShape(compute_s_per_token=compute),
        prefix_tokens=args.prefix_tokens or (1024 if quick else 4096),
        suffix_tokens=32 if quick else 64,
        repeats=args.repeats or (2 if quick else 5),
        deadline_s=30.0 if quick else 480.0,
        seed=args.seed,
    )
    workload = TierWorkloadConfig(
        quick=quick,
        shape=TierShape(bytes_per_token=1024, compute_s_per_token=compute),
        run_deadline_s=30.0 if quick else 150.0,
        seed=args.seed,
    )
    storage = StorageConfig(
        total_bytes=(args.storage_mib or (64 if quick else 1024)) << 20,
        directory=args.storage_dir,
    )
    return Config(ttft, workload, storage, quick, parts, args.json)


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    with exit_on_failure("kv_tiers", "every child was stopped"):
        report = run_all(cfg)
    finish(render(report), report, cfg.json_path, failed(report))


if __name__ == "__main__":
    main()
