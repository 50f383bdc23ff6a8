"""Prometheus scraping: a server's ``/metrics``, its samples (``prometheus_client``'s text parser),
counters summed over label sets, and histogram buckets with their interpolated quantiles."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common.process import BenchError

__all__ = [
    "bucket_delta",
    "histogram_buckets",
    "histogram_quantile",
    "samples",
    "scrape",
    "totals",
    "value",
]


def scrape(client: httpx.Client, url: str) -> str:
    """The exposition at ``{url}/metrics``; ``BenchError`` when it does not answer 2xx."""
    try:
        response = client.get(f"{url}/metrics")
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise BenchError(f"{url}/metrics: {exc}") from exc
    return response.text


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in an exposition."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)


def totals(text: str) -> dict[str, float]:
    """Every sample name's value, summed over its label sets."""
    found: dict[str, float] = {}
    for name, _labels, number in samples(text):
        found[name] = found.get(name, 0.0) + number
    return found


def value(text: str, name: str) -> float | None:
    """The first sample named ``name``; None when there is none."""
    return next((number for sample, _labels, number in samples(text) if sample == name), None)


def histogram_buckets(text: str, name: str) -> dict[float, float] | None:
    """Cumulative bucket counts (upper bound -> count) of histogram ``name``, summed over its
    label sets; None when the exposition has no such histogram."""
    buckets: dict[float, float] = {}
    for sample, labels, number in samples(text):
        if sample == f"{name}_bucket":
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + number
    return buckets or None


def bucket_delta(
    before: Mapping[float, float] | None, after: Mapping[float, float]
) -> dict[float, float]:
    """``after - before`` per bucket (a missing ``before`` counts as zero)."""
    base = before or {}
    return {bound: count - base.get(bound, 0.0) for bound, count in after.items()}


def histogram_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of cumulative ``buckets``, interpolated linearly inside its bucket
    (as Prometheus' ``histogram_quantile``); None without observations. In the ``+Inf`` bucket
    it is the highest finite bound."""
    ordered = sorted(buckets.items())
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = (bound if not math.isinf(bound) else lower), count
    return lower
