"""The printed tables of ``bench.kv_tiers``: one renderer per part."""

from __future__ import annotations

from bench.common.table import or_na, text_table
from bench.kv_tiers.common import CPU_PINNED, DISK, TIERS
from bench.kv_tiers.storage import StorageResult
from bench.kv_tiers.ttft import TierTTFTResult
from bench.kv_tiers.workload import WorkloadResult
from worker.hicache.fetch import PREFETCH_DEPTH

__all__ = ["render_storage", "render_ttft", "render_workload"]


def _head(text: str, count: int = 16) -> list[str]:
    """The first ``count`` lines of an error (a failed cluster's carries its last output)."""
    return text.splitlines()[:count]


def render_ttft(result: TierTTFTResult) -> list[str]:
    cfg, size, shape = result.config, result.sizes, result.config.shape
    head = (
        f"1. tier TTFT: pd-cluster 1P1D --engine sglang, router; {cfg.prefix_tokens}-token "
        f"prefix + {cfg.suffix_tokens}-token unique tail, max_tokens {cfg.max_tokens}, streaming, "
        f"sequential; --compute-s-per-token {shape.compute_s_per_token:g}, --layers "
        f"{shape.layers} --bytes-per-token {shape.bytes_per_token} ({shape.token_bytes >> 10} "
        f"KiB/token), --page-size {shape.page_size}; L1 {size.l1_pages} pages, L2 "
        f"{size.l2_pages}, L3 file {size.l3_pages} (prompt {size.prompt_pages}); prefetch "
        f"wait_complete; {size.l1_fillers} + {size.l2_fillers} filler prompts push the prefix out "
        f"of L1, then L2; up to {cfg.repeats} repeats; {result.wall_s:.0f} s"
    )
    recompute = {r.layerwise: r.ttft_ms_p50 for r in result.rows if r.tier == "recompute"}
    rows = [
        [
            "row",
            "layerwise",
            "n",
            "TTFT p50 ms",
            "vs recompute",
            "over L1 ms",
            "served from (worker metrics)",
            *TIERS,
        ]
    ]
    for row in result.rows:
        p50, base = row.ttft_ms_p50, recompute.get(row.layerwise)
        ratio = None if p50 is None or not base else p50 / base
        n = len(row.samples)
        mean = {t: sum(s.hits[t] for s in row.samples) / n if n else 0.0 for t in TIERS}
        tier = "no tier" if row.tier == "recompute" else row.tier
        rows.append(
            [
                row.label,
                "on" if row.layerwise else "off",
                str(n),
                or_na(p50),
                or_na(ratio, ".3f"),
                or_na(row.over_l1_ms_p50),
                f"{tier}: {row.confirmed}/{n} confirmed",
                *(f"{mean[t]:.0f}" for t in TIERS),
            ]
        )
    lines = [head, "", *text_table(rows, left=1, strip=True), ""]
    lines.append(
        "vs recompute: TTFT p50 / the same cluster's recompute p50; over L1: median of TTFT "
        "minus the same repeat's L1 TTFT (paired, drift-free); GPU/CPU_PINNED/DISK: mean hit "
        "tokens per request of the prefill's pd_worker_hicache_hit_tokens_total{tier}; "
        "confirmed = that tier served >= 90% of the prefix's full pages, the others <= 10% "
        "(recompute: no tier hit)"
    )
    weights = result.weights
    if weights is None:
        lines.append("tier weights: n/a (a row is missing or L1 is not faster than recompute)")
    else:
        flag = ",".join(f"{t}={weights[t]:.2f}" for t in (CPU_PINNED, DISK))
        lines.append(
            "tier weights 1 - over_L1(tier) / over_L1(recompute) (paired medians), clipped "
            f"to [0,1], layerwise-on cluster: suggested router flag --cache-tier-weights {flag}"
        )
    lines += [f"  failed: {line}" for failure in result.failures for line in _head(failure)]
    lines += [f"  {row.label}: {err}" for row in result.rows for err in row.errors[:2]]
    return lines


def render_workload(result: WorkloadResult) -> list[str]:
    cfg, shape = result.config, result.config.shape
    first = result.runs[0]
    head = (
        f"2. workload: {result.trace}; {result.requests} requests, {cfg.concurrency} concurrent "
        f"sessions; pd-cluster {cfg.prefills}P{cfg.decodes}D, router cache_aware (tokenizer), "
        f"--cache-tier-weights {result.router_weights or '(router defaults)'}; "
        f"--compute-s-per-token {shape.compute_s_per_token:g}, {shape.token_bytes >> 10} "
        f"KiB/token; working set {result.working_set_pages} pages, --pages {first.pages} per "
        f"worker ({first.pages / max(result.working_set_pages, 1):.0%} of it); L2 "
        f"{cfg.host_ratio:g} x --pages, L3 file unbounded; {cfg.prefetch_policy} prefetch; "
        f"{result.wall_s:.0f} s"
    )
    rows = [
        [
            "run",
            "L2 pages",
            "n",
            "err",
            "TTFT p50",
            "p99",
            "req/s",
            "hit %",
            *TIERS,
            "prompt tok",
            "L3 MiB written",
            "read",
        ]
    ]
    for run in result.runs:
        res = run.result
        rows.append(
            [
                run.label,
                str(run.host_pages),
                str(res.completed),
                str(res.errors),
                f"{res.ttft_ms.p50:.1f}",
                f"{res.ttft_ms.p99:.1f}",
                f"{res.req_per_s:.2f}",
                or_na(None if res.hit_ratio is None else res.hit_ratio * 100),
                *(f"{run.tier_hits.get(t, 0.0):.0f}" for t in TIERS),
                f"{run.prompt_tokens:.0f}",
                f"{run.l3_written_mib:.0f}",
                f"{run.l3_read_mib:.0f}",
            ]
        )
    lines = [head, "", *text_table(rows, left=1, strip=True), ""]
    plain, tiered = (run.result for run in result.runs)
    if plain.completed and tiered.completed and tiered.ttft_ms.p50 and plain.req_per_s:
        lines.append(
            f"with / without tiers: TTFT p50 x{tiered.ttft_ms.p50 / plain.ttft_ms.p50:.2f}, "
            f"p99 x{tiered.ttft_ms.p99 / max(plain.ttft_ms.p99, 1e-9):.2f}, "
            f"req/s x{tiered.req_per_s / plain.req_per_s:.2f}"
        )
    lines.append(
        "TTFT in ms; hit % = engines' cached / prompt tokens; GPU/CPU_PINNED/DISK: prompt tokens "
        "served from each tier (prefills' counters); L3 MiB written/read: backups into and "
        "prefetches out of the file store"
    )
    lines += [
        f"  {run.label}: {line}" for run in result.runs for e in run.errors for line in _head(e)
    ]
    return lines


def render_storage(result: StorageResult) -> list[str]:
    cfg, speeds = result.config, result.mib_s
    head = (
        f"3. storage: DirectoryPageStore prefetch (StorageTier.read, {PREFETCH_DEPTH} reads in "
        f"flight, as the controller's prefetch) vs raw sequential read (4 MiB chunks); "
        f"{cfg.pages} pages x "
        f"{cfg.page_bytes >> 10} KiB = {result.bytes_read / (1 << 20):.0f} MiB; cold = after "
        f"fsync + POSIX_FADV_DONTNEED; {result.filesystem}"
    )
    rows = [["read", "MiB/s", "vs raw"]]
    names = (
        "raw cold",
        "page files cold, plain read",
        "prefetch cold",
        "prefetch cold depth 1",
        "raw warm",
        "prefetch warm",
    )
    for name in names:
        raw = speeds["raw warm" if "warm" in name else "raw cold"]
        rows.append([name, f"{speeds[name]:.0f}", f"{speeds[name] / raw:.0%}"])
    rows.append(["CRC-32 checksum alone (in memory)", f"{speeds['checksum']:.0f}", ""])
    return [head, "", *text_table(rows, left=1, strip=True), "", result.verdict]
