"""Merge the Prometheus expositions of a router's sibling processes into one.

With ``router --workers N`` every process keeps its own registry; the process that receives a
scrape fetches each sibling's own exposition (text format 0.0.4, as ``generate_latest`` writes
it) and serves ``merge_expositions`` of them all, with ``CONTENT_TYPE_LATEST``.

Rules, per sample (same name and labels):

- counters, histograms (buckets, ``_sum``, ``_count``) and summaries: the sum; their ``_created``
  series (0.0.4 writes them as a separate ``<name>_created`` gauge family): the minimum;
- gauges: the family's policy in ``GAUGE_POLICIES``; a gauge not in the table is summed
  (a new per-process amount is the common case), one named ``*_info`` is ``same``;
- untyped families: ``same``.

prometheus-client parses and renders; HELP and TYPE come from the first text that has the
family; samples are sorted by labels (histogram buckets by bound), so the output does not depend
on which process took the scrape. Exemplars and timestamps are dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = [
    "GAUGE_POLICIES",
    "MAX_TEXTS",
    "MergeReport",
    "Policy",
    "merge_expositions",
    "merge_expositions_report",
]

logger = logging.getLogger(__name__)

MAX_TEXTS = 64  # a router runs at most this many processes

Policy = Literal["sum", "max", "min", "same"]


def _group(policy: Policy, *names: str) -> dict[str, Policy]:
    return dict.fromkeys(names, policy)


# How each gauge's per-process values combine. Add a gauge to the group whose reason fits it.
GAUGE_POLICIES: Mapping[str, Policy] = MappingProxyType(
    {
        # per-process amounts: each process holds its own requests, slots, tasks and memory
        **_group(
            "sum",
            "pdr_requests_inflight",
            "pdr_admission_queue_depth",
            "pdr_admission_queued",
            "pdr_worker_queue_depth",
            "pdr_event_loop_tasks",
            "pdr_worker_inflight",
            "pdr_prefill_pending_tokens",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_open_fds",
        ),
        # flags each process decides for itself where the bad value is the one to see: a worker,
        # the registry watch or a load reading counts as up only if every process has it up (an
        # alert on "< 1" fires when one process cannot reach it)
        **_group("min", "pdr_worker_healthy", "pdr_registry_up", "pdr_engine_load_fresh"),
        # ... and where the set flag is: draining, a breaker open, a suspect pair in any process
        **_group(
            "max",
            "pdr_worker_draining",
            "pdr_worker_circuit_open",
            "pdr_pd_pair_circuit_open",
            "pdr_pd_pair_suspect",
            # each process judges the routing states from its own requests: a state any
            # process is in shows (a rank may then show two)
            "pdr_routing_state",
            "pdr_routing_pool_state",
        ),
        # the same fleet state read by every process (engine load reports, the KV index fed by
        # the same events): summing would count it once per process
        **_group(
            "max",
            "pdr_engine_requests_running",
            "pdr_engine_requests_waiting",
            "pdr_engine_kv_cache_usage_ratio",
            "pdr_kv_index_blocks",
        ),
        # the replicas' sync: every process follows the peers; the worst view is the one to see
        **_group(
            "max",
            "pdr_replica_peers",
            "pdr_replica_degraded",
            "pdr_replica_state_age_seconds",
            "pdr_replica_sync_lag_seconds",
        ),
        # one limit of the host, identical in every process
        **_group("max", "process_max_fds"),
        # the router started when its first process did
        **_group("min", "process_start_time_seconds"),
        # identical in every process: labels carry the information, the value is 1
        **_group("same", "python_info"),
    }
)

_DEFAULT_GAUGE_POLICY: Policy = "sum"
_CUMULATIVE = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
_CREATED = "_created"
_BOUNDS = ("le", "quantile")  # sorted as numbers, after the other labels

# ``same``: equal everywhere, so the first value; if they differ, the largest
_REDUCERS: Mapping[Policy, Callable[[list[float]], float]] = {
    "sum": math.fsum,
    "max": max,
    "min": min,
    "same": max,
}

_Labels = tuple[tuple[str, str], ...]
_Key = tuple[str, _Labels]  # sample name, sorted labels


@dataclass(frozen=True, slots=True)
class MergeReport:
    """The merged exposition, and what could not go into it.

    ``skipped``: indexes of the texts that failed to parse (nothing of them is merged);
    ``conflicts``: families dropped from a later text because its TYPE differed from the first.
    """

    body: bytes
    merged: int
    skipped: tuple[int, ...]
    conflicts: tuple[str, ...]


@dataclass(slots=True)
class _Family:
    name: str
    documentation: str
    type: str
    values: dict[_Key, list[float]] = field(default_factory=dict)


class _Collected(Collector):
    """Hands ready-made families to ``generate_latest``."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return iter(self._metrics)


def merge_expositions(texts: Sequence[str]) -> bytes:
    """One exposition of ``texts`` (see the module docstring for the rules).

    A text that fails to parse is left out and logged at WARNING; use
    ``merge_expositions_report`` to learn which. Raises ``ValueError`` for more than
    ``MAX_TEXTS`` texts. Pure CPU work, no I/O.
    """
    report = merge_expositions_report(texts)
    if report.skipped or report.conflicts:
        logger.warning(
            "metrics merge: %d of %d expositions unparseable (indexes %s), "
            "families with conflicting types: %s",
            len(report.skipped),
            len(texts),
            list(report.skipped),
            list(report.conflicts),
        )
    return report.body


def merge_expositions_report(texts: Sequence[str]) -> MergeReport:
    """As ``merge_expositions``, returning the body with what was skipped; logs nothing."""
    if len(texts) > MAX_TEXTS:
        raise ValueError(f"at most {MAX_TEXTS} expositions can be merged, got {len(texts)}")
    families: dict[str, _Family] = {}
    skipped: list[int] = []
    conflicts: list[str] = []
    for index, text in enumerate(texts):
        parsed = _parse(text)
        if parsed is None:
            skipped.append(index)
            continue
        for metric in parsed:
            if not _add(families, metric):
                conflicts.append(metric.name)
    metrics = [_render(family, families) for family in families.values()]
    body = generate_latest(_Collected(metrics))
    return MergeReport(body, len(texts) - len(skipped), tuple(skipped), tuple(conflicts))


def _parse(text: str) -> list[Metric] | None:
    """Every family of ``text``, or None when any of it fails to parse (all or nothing)."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:  # the parser's only error for malformed text
        return None


def _add(families: dict[str, _Family], metric: Metric) -> bool:
    """Collect ``metric``'s sample values; False (nothing added) if its type conflicts."""
    family = families.get(metric.name)
    if family is None:
        family = families[metric.name] = _Family(metric.name, metric.documentation, metric.type)
    elif family.type != metric.type:
        return False
    for sample in metric.samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        family.values.setdefault(key, []).append(sample.value)
    return True


def _render(family: _Family, families: Mapping[str, _Family]) -> Metric:
    policy = _family_policy(family, families)
    metric = Metric(family.name, family.documentation, family.type)
    for key in sorted(family.values, key=_order):
        name, labels = key
        reducer = _REDUCERS["min" if _is_created_sample(family, name) else policy]
        metric.add_sample(name, dict(labels), reducer(family.values[key]))
    return metric


def _family_policy(family: _Family, families: Mapping[str, _Family]) -> Policy:
    if family.type in _CUMULATIVE:
        return "sum"
    if family.type != "gauge":  # untyped (and info or stateset, should a parser yield them)
        return "same"
    if family.name in GAUGE_POLICIES:
        return GAUGE_POLICIES[family.name]
    if family.name.endswith(_CREATED):
        parent = families.get(family.name.removesuffix(_CREATED))
        if parent is not None and parent.type in _CUMULATIVE:
            return "min"  # the creation time of a counter, histogram or summary series
    if family.name.endswith("_info"):
        return "same"
    return _DEFAULT_GAUGE_POLICY


def _is_created_sample(family: _Family, sample_name: str) -> bool:
    """A ``_created`` sample kept inside its family (OpenMetrics-style), not split out."""
    return family.type in _CUMULATIVE and sample_name == family.name + _CREATED


def _order(key: _Key) -> tuple[_Labels, str, float, str]:
    """Other labels, then the sample name (``_bucket`` < ``_count`` < ``_sum``), then the
    bucket or quantile bound as a number."""
    name, labels = key
    rest = tuple(item for item in labels if item[0] not in _BOUNDS)
    bound = next((value for label, value in labels if label in _BOUNDS), "")
    try:
        number = float(bound) if bound else 0.0
    except ValueError:  # a label named like a bound that is not a number: order as text
        number = math.inf
    return rest, name, number, bound
