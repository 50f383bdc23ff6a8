"""bench.kv_tiers: the counter parsing, the row confirmation, the weights, the pool sizing, and
one ``--quick`` run end to end (real pd-clusters, a real store): the structure and the sanity
that must hold (every TTFT row served from the tier it claims, by the worker's own metrics; L1
faster than recompute; the JSON written), never a performance threshold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bench.kv_tiers.common import CPU_PINNED, DISK, GPU, TierCounters, parse_counters
from bench.kv_tiers.main import failed, parse_args, render, run_all, write_json
from bench.kv_tiers.storage import StorageConfig, run_storage
from bench.kv_tiers.ttft import (
    ROWS,
    TierRow,
    TierSample,
    TierTTFTConfig,
    confirm,
    sizes,
    tier_weights,
)
from worker.hicache.metrics import TierMetrics


def _exposition(hits: dict[str, int], prefetched: int = 0, ranks: int = 1) -> str:
    registry = CollectorRegistry()
    families = TierMetrics(registry, "m", "dp_rank")
    for index in range(ranks):
        rank = families.rank(index)
        for tier, count in hits.items():
            rank.served(tier, count, 7)
        if prefetched:
            rank.prefetched(prefetched, prefetched * 100, 0.01)
        rank.backed_up(DISK, 3, 300, 0.01)
    return generate_latest(registry).decode()


def test_worker_tier_counters_parse_sum_and_subtract() -> None:
    before = parse_counters(_exposition({GPU: 10, CPU_PINNED: 0}))
    after = parse_counters(_exposition({GPU: 10, CPU_PINNED: 64, DISK: 32}, prefetched=2, ranks=2))
    assert before.tiered and after.tiered
    assert after.hit(CPU_PINNED) == 128 and after.hit(DISK) == 64 and after.prefetch_pages == 4
    delta = after - before
    assert delta.hits == {GPU: 10.0, CPU_PINNED: 128.0, DISK: 64.0}
    assert delta.backups == {DISK: 3.0}
    assert not parse_counters("sglang:cached_tokens_total 5.0\n").tiered
    assert (before + before).hit(GPU) == 20 and TierCounters().hit(DISK) == 0


def test_a_row_is_confirmed_only_by_its_own_tier() -> None:
    assert confirm(GPU, {GPU: 4096, CPU_PINNED: 0, DISK: 0}, 4096)
    assert confirm(CPU_PINNED, {GPU: 16, CPU_PINNED: 4080, DISK: 0}, 4096)
    assert not confirm(CPU_PINNED, {GPU: 2048, CPU_PINNED: 2048, DISK: 0}, 4096)
    assert not confirm(DISK, {GPU: 0, CPU_PINNED: 4096, DISK: 0}, 4096)
    assert confirm("recompute", {GPU: 0, CPU_PINNED: 0, DISK: 0}, 4096)
    assert not confirm("recompute", {GPU: 16}, 4096)


def _row(label: str, tier: str, layerwise: bool, ms: float, over_ms: float = 10.0) -> TierRow:
    over = over_ms / 1e3
    samples = (TierSample(ms / 1e3, {}, 0.0, 0.0, True, over), TierSample(ms / 1e3, {}, 0, 0, True))
    return TierRow(label, tier, layerwise, samples)


def test_weights_scale_between_l1_and_recompute_and_clip() -> None:
    # whole-TTFT p50s drifted (L2's is above recompute's); the paired costs over L1 did not
    rows = [
        _row("recompute", "recompute", True, 1000.0, over_ms=800.0),
        _row("L1", GPU, True, 200.0, over_ms=0.0),
        _row("L2", CPU_PINNED, True, 1040.0, over_ms=40.0),
        _row("L2 off", CPU_PINNED, False, 900.0, over_ms=700.0),  # not the default: ignored
        _row("L3", DISK, True, 1100.0, over_ms=900.0),
    ]
    weights = tier_weights(rows)
    assert weights == {CPU_PINNED: pytest.approx(0.95), DISK: 0.0}
    assert rows[0].ttft_ms_p50 == pytest.approx(1000.0) and rows[0].over_l1_ms_p50 == 800.0
    assert tier_weights(rows[:2]) is None
    no_cost = [_row("r", "recompute", True, 100.0, over_ms=0.0), _row("l", GPU, True, 150.0)]
    assert tier_weights(no_cost) is None


@pytest.mark.parametrize("prefix", [1024, 4096, 8000])
def test_pools_are_sized_so_the_fillers_evict_as_planned(prefix: int) -> None:
    s = sizes(TierTTFTConfig(prefix_tokens=prefix))
    p = s.prompt_pages
    assert s.l1_pages >= p  # one prompt fits the device pool
    assert s.l1_fillers * p > s.l1_pages  # the first fillers push the prefix out of L1 ...
    assert (1 + s.l1_fillers) * p < s.l2_pages  # ... not out of L2
    assert s.l2_fillers * p > s.l2_pages  # the next push it out of L2 ...
    assert (2 + s.l1_fillers + s.l2_fillers) * p <= s.l3_pages  # ... not out of L3


def test_storage_measures_cold_warm_and_hash(tmp_path: Path) -> None:
    result = run_storage(
        StorageConfig(total_bytes=4 << 20, page_bytes=256 << 10, directory=tmp_path)
    )
    assert result.bytes_read == 4 << 20
    for name in ("raw cold", "raw warm", "prefetch cold", "prefetch warm", "checksum"):
        assert result.mib_s[name] > 0
    assert result.verdict.startswith("PASS" if result.passed else "FAIL")
    assert list(tmp_path.iterdir()) == []  # its files are gone


def test_cli_quick() -> None:
    cfg = parse_args(["--quick", "--parts", "ttft,storage"])
    assert cfg.quick and cfg.parts == ("ttft", "storage")
    assert cfg.ttft.prefix_tokens == 1024 and cfg.storage.total_bytes == 64 << 20
    with pytest.raises(SystemExit):
        parse_args(["--parts", "nope"])


@pytest.mark.slow  # ~60 s: scripts/test-slow (CI runs it)
@pytest.mark.timeout(240)
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    cfg = parse_args(["--quick", "--json", str(tmp_path / "kv.json")])
    report = run_all(cfg)
    text = render(report)
    assert cfg.json_path is not None
    write_json(report, cfg.json_path)
    assert not failed(report), text

    ttft = report.ttft
    assert ttft is not None and not ttft.failures, text
    assert [row.label for row in ttft.rows] == [label for label, _t, _l in ROWS]
    for row in ttft.rows:
        assert row.samples and row.confirmed == len(row.samples), text  # its tier served it
    for layerwise in (True, False):
        p50 = {row.tier: row.ttft_ms_p50 for row in ttft.rows if row.layerwise == layerwise}
        l1, recompute = p50[GPU], p50["recompute"]
        assert l1 is not None and recompute is not None and l1 < recompute, text
    assert ttft.weights is not None and set(ttft.weights) == {CPU_PINNED, DISK}
    assert "--cache-tier-weights CPU_PINNED=" in text

    workload = report.workload
    assert workload is not None and [r.label for r in workload.runs] == ["no tiers", "L2+L3"]
    for run in workload.runs:
        assert run.result.completed == workload.requests and not run.result.errors, text
    plain, tiered = workload.runs
    assert plain.tier_hits.get(CPU_PINNED, 0) == 0 and plain.host_pages == 0
    assert tiered.tier_hits.get(CPU_PINNED, 0) + tiered.tier_hits.get(DISK, 0) > 0, text
    assert "with / without tiers" in text

    storage = report.storage
    assert storage is not None and storage.ratio > 0
    assert ("PASS" if storage.passed else "FAIL") in text

    saved = json.loads(cfg.json_path.read_text())
    assert set(saved) >= {"ttft", "workload", "storage"}
    assert saved["ttft"]["rows"][0]["samples"]
