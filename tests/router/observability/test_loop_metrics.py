"""The request path's counters and histograms (``router.observability.loop_metrics``) expose
exactly what prometheus-client's own ``Counter`` and ``Histogram`` expose for the same updates,
so dashboards, alerts and the ``--workers`` merge read them unchanged."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.observability.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.0025, 0.01, 0.5, 1.0, 2.5, 640.0)
# on a bound, between bounds, below the first, beyond the last, 0, a negative duration
VALUES = (0.001, 0.0011, 0.0004, 700.0, 0.0, -0.5, 2.5, 0.75, 0.75, 1e-9)
_CREATED = re.compile(rb"^(\w+_created(?:\{[^}]*\})?) \S+$", re.MULTILINE)


def _exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition, each ``_created`` value (a time) blanked."""
    return _CREATED.sub(rb"\1 T", generate_latest(registry))


def _both() -> tuple[CollectorRegistry, CollectorRegistry]:
    return CollectorRegistry(), CollectorRegistry()


def test_a_histogram_exposes_what_prometheus_clients_exposes() -> None:
    theirs, ours = _both()
    reference = Histogram("pdr_x_seconds", "doc", ["role"], buckets=BUCKETS, registry=theirs)
    mine = LoopHistogram("pdr_x_seconds", "doc", ["role"], buckets=BUCKETS, registry=ours)
    plain_reference = Histogram("pdr_y_seconds", "plain", buckets=BUCKETS, registry=theirs)
    plain = LoopHistogram("pdr_y_seconds", "plain", buckets=BUCKETS, registry=ours)
    for index, value in enumerate(VALUES):
        role = ("prefill", "decode")[index % 2]
        reference.labels(role).observe(value)
        mine.child((role,)).observe(value)  # the request path's lookup (RouterMetrics.observe)
        plain_reference.observe(value)
        plain.observe(value)
    assert _exposition(ours) == _exposition(theirs)
    assert b'pdr_x_seconds_bucket{le="+Inf",role="decode"} 5.0' in _exposition(ours)


def test_a_counter_exposes_what_prometheus_clients_exposes() -> None:
    theirs, ours = _both()
    reference = Counter("pdr_z", "doc", ["kind", "to"], registry=theirs)
    mine = LoopCounter("pdr_z", "doc", ["kind", "to"], registry=ours)
    plain_reference = Counter("pdr_w_total", "plain", registry=theirs)
    plain = LoopCounter("pdr_w_total", "plain", registry=ours)
    for kind, to in [("a", "b"), ("a", "b"), ("c", "d")]:
        reference.labels(kind, to).inc()
        mine.labels(kind, to).inc()
    reference.labels("e", "f")  # made, never counted: 0
    mine.labels("e", "f")
    plain_reference.inc(2.5)
    plain.inc(2.5)
    assert _exposition(ours) == _exposition(theirs)


def test_bad_updates_and_names_are_refused_as_prometheus_client_refuses_them() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("pdr_v", "doc", ["kind"], registry=registry)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("a", "b")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopCounter("pdr_v", "again", registry=registry)
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("pdr_u_seconds", "doc", buckets=(1.0, 0.5))
