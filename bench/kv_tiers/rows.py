"""The rows of ``bench.kv_tiers``' tier TTFT table (``bench.kv_tiers.ttft``): the samples, how a
sample is confirmed served from its tier by the worker's counters, and the router tier weights
the rows imply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.kv_tiers.common import CPU_PINNED, DISK, GPU, TIERS

__all__ = ["RECOMPUTE", "ROWS", "TierRow", "TierSample", "confirm", "tier_weights"]

RECOMPUTE = "recompute"
# (row label, the tier it claims, layer-by-layer loading) in table order: a block per cluster
ROWS: tuple[tuple[str, str, bool], ...] = tuple(
    (label, tier, layerwise)
    for layerwise in (True, False)
    for label, tier in (
        ("recompute", RECOMPUTE),
        ("L1 (GPU)", GPU),
        ("L2 (CPU_PINNED)", CPU_PINNED),
        ("L3 (DISK)", DISK),
    )
)
_SERVED, _STRAY = 0.9, 0.1


@dataclass(frozen=True)
class TierSample:
    ttft_s: float
    hits: dict[str, float]  # tier -> hit tokens of this request (the prefill's counters)
    load_pages: float
    prefetch_pages: float
    confirmed: bool
    over_l1_s: float | None = None  # minus the same repeat's L1 ask (same cluster)


@dataclass(frozen=True)
class TierRow:
    label: str
    tier: str  # GPU, CPU_PINNED, DISK or "recompute"
    layerwise: bool  # the cluster's --hicache-layerwise
    samples: tuple[TierSample, ...]
    errors: tuple[str, ...] = ()

    @property
    def ttft_ms_p50(self) -> float | None:
        return _median_ms([s.ttft_s for s in self.samples])

    @property
    def over_l1_ms_p50(self) -> float | None:
        """The median of (this TTFT - the same repeat's L1 TTFT): what the tier costs over L1,
        free of the drift between repeats and clusters."""
        return _median_ms([s.over_l1_s for s in self.samples if s.over_l1_s is not None])

    @property
    def confirmed(self) -> int:
        return sum(s.confirmed for s in self.samples)


def _median_ms(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return median * 1e3


def confirm(tier: str, hits: dict[str, float], expected: int) -> bool:
    """Whether ``hits`` (one request's hit tokens per tier) show it served from ``tier``."""
    if tier == RECOMPUTE:
        return all(hits.get(t, 0.0) == 0 for t in TIERS)
    others = sum(hits.get(t, 0.0) for t in TIERS if t != tier)
    return hits.get(tier, 0.0) >= _SERVED * expected and others <= _STRAY * expected


def tier_weights(rows: Sequence[TierRow]) -> dict[str, float] | None:
    """weight(tier) = 1 - cost(tier) / cost(recompute), in [0, 1], where cost is the paired
    median TTFT over the same repeat's L1 ask (``over_l1_ms_p50``: free of the drift between
    repeats, which moved whole-TTFT p50s by 100-300 ms here), from the layer-by-layer
    cluster's rows (the worker's default); None without them. Equal to
    ``(TTFT_recompute - TTFT_tier) / (TTFT_recompute - TTFT_L1)`` without drift."""
    over = {row.tier: row.over_l1_ms_p50 for row in rows if row.layerwise}
    recompute = over.get(RECOMPUTE)
    if recompute is None or recompute <= 0:
        return None
    weights = {}
    for tier in (CPU_PINNED, DISK):
        value = over.get(tier)
        if value is None:
            return None
        weights[tier] = min(1.0, max(0.0, 1.0 - value / recompute))
    return weights
