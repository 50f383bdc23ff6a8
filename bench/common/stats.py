"""Percentiles of measured durations: p50/p90/p99 interpolated, and nearest-rank."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

__all__ = ["Percentiles", "nearest_rank", "percentiles"]


class Percentiles(msgspec.Struct, frozen=True):
    """p50/p90/p99 in milliseconds (0 when there were no samples)."""

    p50: float
    p90: float
    p99: float


def percentiles(values_s: Sequence[float]) -> Percentiles:
    """p50/p90/p99 of durations in seconds, in ms, by linear interpolation (numpy's default)."""
    ordered = sorted(values_s)
    if not ordered:
        return Percentiles(0.0, 0.0, 0.0)
    return Percentiles(*(1000.0 * _quantile(ordered, q) for q in (0.50, 0.90, 0.99)))


def _quantile(ordered: Sequence[float], q: float) -> float:
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]
