"""Counters and histograms that the request path updates from the event loop's thread only:
plain numbers, no lock per update, made into Prometheus families by prometheus-client at
scrape time.

prometheus-client's ``Counter`` and ``Histogram`` take a lock for each value they move (a
histogram: its sum and its bucket, found by a scan of the bounds), ~0.25 µs an ``inc`` and
~0.55 µs an ``observe``; a request moves about five of them. Here an ``inc`` adds to a float
and an ``observe`` bisects the bounds and adds to one bucket's count (~0.1 µs). That is safe
because every update and every scrape (``RouterMetrics.render``) runs on the event loop's
thread.

The exposition is prometheus-client's own for the same metric: ``NAME_total`` and
``NAME_created`` for a counter; ``NAME_bucket`` (cumulative, ``le`` as it writes bounds),
``NAME_count``, ``NAME_sum`` and ``NAME_created`` for a histogram.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["CounterChild", "HistogramChild", "Labelled", "LoopCounter", "LoopHistogram"]


class CounterChild:
    """One label set's count."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class HistogramChild:
    """One label set's observations: a count per bucket (not cumulative; the last one: beyond
    every bound) and their sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        # the first bound >= value: Prometheus buckets count ``value <= le``
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


Child = TypeVar("Child", CounterChild, HistogramChild)


class Labelled(Collector, Generic[Child]):
    """What both kinds share: the name, the label names, registration, the children by label
    values (``labels``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> Child:
        """The child of ``values`` (one per label name), made on first use."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        key = tuple(str(value) for value in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def child(self, values: tuple[str, ...]) -> Child:
        """``labels(*values)`` for label values that are strings already: one lookup once
        made (the request path's way)."""
        return self._children.get(values) or self.labels(*values)

    def _new_child(self) -> Child:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(Labelled[CounterChild]):
    """A counter, by label values (``labels``) or, without label names, on its own (``inc``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)
        if not self.labelnames:
            self.inc = self.labels().inc

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


class LoopHistogram(Labelled[HistogramChild]):
    """A histogram of ``buckets`` (upper bounds, ``+Inf`` added), by label values (``labels``)
    or, without label names, on its own (``observe``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(name, documentation, labelnames, registry)
        bounds = tuple(float(bound) for bound in buckets if bound != math.inf)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be distinct and in increasing order")
        self._bounds = bounds
        # prometheus-client's own text for a bound (untyped there)
        self._le: list[str] = [floatToGoString(b) for b in (*bounds, math.inf)]  # type: ignore[no-untyped-call]
        if not self.labelnames:
            self.observe = self.labels().observe

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            total, cumulative = 0, []
            for le, count in zip(self._le, list(child.counts), strict=True):
                total += count
                cumulative.append((le, float(total)))
            family.add_metric(values, cumulative, child.sum)
            labels = dict(zip(self.labelnames, values, strict=True))
            family.samples.append(Sample(f"{self.name}_created", labels, child.created))
        yield family
