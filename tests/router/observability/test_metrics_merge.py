"""merge_expositions over the real router metrics of several processes.

Each "process" is a real ``RouterMetrics`` with the router's scrape-time ``RouterStateCollector``
registered, as ``router.context`` wires them, over one shared fleet (a prefill and a decode with
the same URLs in every process). A reference process that sees all the traffic gives the totals
the merged counters and histograms must show.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from router.fleet.discovery import RegistryStatus
from router.kv_cache.event_feed import KVEventFeed
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.observability.metrics import RouterMetrics
from router.observability.metrics_merge import (
    GAUGE_POLICIES,
    MAX_TEXTS,
    merge_expositions,
    merge_expositions_report,
)
from router.observability.pair_ledger import PairLedger
from router.observability.state_metrics import RouterStateCollector
from router.settings import CacheAwareSettings
from router.upstream.base import UpstreamClient, UpstreamPool
from router.workers import Role, Worker, WorkerPool

Key = tuple[str, tuple[tuple[str, str], ...]]
PREFILL, DECODE = "http://10.0.0.1:8100", "http://10.0.0.2:8200"
# per process: (endpoint, status, stream, duration_s, pd_pair_served)
TRAFFIC = [
    [("chat", "200", "true", 0.2, True), ("chat", "200", "true", 3.0, True)],
    [("chat", "200", "true", 0.7, True), ("completions", "503", "false", 0.04, False)],
    [
        ("completions", "200", "false", 12.0, True),
        ("chat", "200", "true", 0.05, True),
        ("chat", "499", "true", 0.01, False),
    ],
]
CUMULATIVE_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


@dataclass
class Process:
    """One router process's metrics over the shared fleet."""

    metrics: RouterMetrics
    prefill: Worker
    decode: Worker
    pairs: PairLedger
    registry_ok: bool = True

    def record(self, traffic: Sequence[tuple[str, str, str, float, bool]]) -> None:
        m = self.metrics
        for endpoint, status, stream, duration, served in traffic:
            m.count(m.requests, endpoint, status, stream)
            m.observe(m.request_seconds, duration, endpoint, stream)
            if served:
                key = (self.prefill.id, self.decode.id)
                self.pairs.served(key, self.prefill.public_url, self.decode.public_url)

    def text(self) -> str:
        return self.metrics.render().decode()


def router_process() -> Process:
    metrics = RouterMetrics()
    pool: UpstreamPool = WorkerPool(needs_engine_ids=False)
    prefill = Worker(Role.PREFILL, PREFILL, healthy=True)
    decode = Worker(Role.DECODE, DECODE, healthy=True)
    for worker in (prefill, decode):
        pool.add(worker, cast(UpstreamClient, None))  # the collector never calls the client
    index = KVBlockIndex(1000)
    feed = KVEventFeed(lambda: pool.prefill, index, ApproxPrefixTree(1 << 16), CacheAwareSettings())
    process = Process(metrics, prefill, decode, PairLedger())
    status = lambda: RegistryStatus("memory://", ok=process.registry_ok)  # noqa: E731
    metrics.registry.register(RouterStateCollector(pool, process.pairs, index, feed, status))
    return process


def samples(text: str | bytes) -> dict[Key, float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str | bytes, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def processes() -> list[Process]:
    out = [router_process() for _ in TRAFFIC]
    for process, traffic in zip(out, TRAFFIC, strict=True):
        process.record(traffic)
    return out


def test_counters_and_histograms_sum_to_the_traffic_totals(processes: list[Process]) -> None:
    reference = router_process()  # one process that saw every request
    for traffic in TRAFFIC:
        reference.record(traffic)
    merged = samples(merge_expositions([p.text() for p in processes]))
    expected = {
        k: v for k, v in samples(reference.text()).items() if k[0].endswith(CUMULATIVE_SUFFIXES)
    }
    assert expected  # requests, durations, pair counts and the pre-started zeros
    got = {k: v for k, v in merged.items() if k[0].endswith(CUMULATIVE_SUFFIXES)}
    assert got == pytest.approx(expected)
    chat = sum(1 for t in TRAFFIC for r in t if r[:3] == ("chat", "200", "true"))
    labels = {"endpoint": "chat", "status": "200", "stream": "true"}
    assert merged[("pdr_requests_total", tuple(sorted(labels.items())))] == chat


def test_inflight_gauges_sum_over_processes(processes: list[Process]) -> None:
    for n, process in enumerate(processes):
        process.metrics.requests_inflight.set(n * 2 + 1)
        process.decode.inflight = n + 3
    merged = merge_expositions([p.text() for p in processes])
    assert value(merged, "pdr_requests_inflight") == sum(n * 2 + 1 for n in range(len(processes)))
    got = value(merged, "pdr_worker_inflight", role="decode", worker=DECODE)
    assert got == sum(p.decode.inflight for p in processes)


def test_health_gauges_take_the_min(processes: list[Process]) -> None:
    processes[1].decode.healthy = False  # one process's probe failed: the operator sees it
    processes[2].registry_ok = False
    merged = merge_expositions([p.text() for p in processes])
    assert value(merged, "pdr_worker_healthy", role="decode", worker=DECODE) == 0
    assert value(merged, "pdr_worker_healthy", role="prefill", worker=PREFILL) == 1
    assert value(merged, "pdr_registry_up") == 0
    for process in processes:
        process.decode.healthy = True
        process.registry_ok = True
    merged = merge_expositions([p.text() for p in processes])
    assert value(merged, "pdr_worker_healthy", role="decode", worker=DECODE) == 1
    assert value(merged, "pdr_registry_up") == 1


def test_created_is_the_earliest(processes: list[Process]) -> None:
    texts = [p.text() for p in processes]
    labels = {"endpoint": "chat", "status": "200", "stream": "true"}
    created = [value(t, "pdr_requests_created", **labels) for t in texts]
    retries = [value(t, "pdr_retries_created", role="prefill") for t in texts]
    assert created[0] < created[1] < created[2]  # recorded in process order
    merged = merge_expositions(texts[::-1])  # the earliest is not the first text
    assert value(merged, "pdr_requests_created", **labels) == created[0]
    assert value(merged, "pdr_retries_created", role="prefill") == min(retries)


def families(text: str | bytes) -> list[tuple[str, str, str]]:
    text = text.decode() if isinstance(text, bytes) else text
    return [(f.name, f.type, f.documentation) for f in text_string_to_metric_families(text)]


def test_help_and_type_are_kept(processes: list[Process]) -> None:
    merged = merge_expositions([p.text() for p in processes])
    assert families(merged) == families(processes[0].text())
    assert "# TYPE pdr_requests_total counter" in merged.decode()


def test_the_output_does_not_depend_on_which_process_took_the_scrape(
    processes: list[Process],
) -> None:
    texts = [p.text() for p in processes]
    assert merge_expositions(texts) == merge_expositions(texts[::-1])
    assert merge_expositions(texts) == merge_expositions([*texts[1:], texts[0]])


def test_a_text_that_does_not_parse_is_skipped_and_reported(
    processes: list[Process], caplog: pytest.LogCaptureFixture
) -> None:
    good = [p.text() for p in processes[:2]]
    truncated = processes[2].text() + 'pdr_requests_total{endpoint="chat'  # cut mid-line
    report = merge_expositions_report([good[0], "garbage", good[1], truncated])
    assert report.skipped == (1, 3)
    assert report.merged == 2
    assert report.body == merge_expositions(good)  # nothing of the truncated text leaks in
    with caplog.at_level(logging.WARNING, "router.observability.metrics_merge"):
        assert merge_expositions([good[0], "garbage"]) == merge_expositions(good[:1])
    assert "unparseable" in caplog.text


def test_at_most_max_texts(processes: list[Process]) -> None:
    text = processes[0].text()
    merged = merge_expositions([text] * MAX_TEXTS)
    labels = {"endpoint": "chat", "status": "200", "stream": "true"}
    one = value(text, "pdr_requests_total", **labels)
    assert value(merged, "pdr_requests_total", **labels) == one * MAX_TEXTS
    with pytest.raises(ValueError, match=str(MAX_TEXTS)):
        merge_expositions([text] * (MAX_TEXTS + 1))


def test_a_family_whose_type_conflicts_is_dropped_from_the_later_text() -> None:
    gauges, clash = router_process(), CollectorRegistry()
    gauges.metrics.requests_inflight.set(4)
    Counter("pdr_requests_inflight", "the same name, another type", registry=clash).inc(7)
    texts = [gauges.text(), generate_latest(clash).decode(), gauges.text()]
    report = merge_expositions_report(texts)
    assert report.conflicts == ("pdr_requests_inflight",)
    assert report.skipped == ()
    assert value(report.body, "pdr_requests_inflight") == 4 + 4  # the gauges only
    assert ("pdr_requests_inflight_total", ()) not in samples(report.body)


async def test_every_router_gauge_has_a_chosen_policy() -> None:
    """A new gauge is summed by default; this makes its author choose (GAUGE_POLICIES)."""
    registry = router_process().metrics.registry  # collected in the loop: its task gauge too
    gauges = {m.name for m in registry.collect() if m.type == "gauge"}
    assert "pdr_event_loop_tasks" in gauges
    assert gauges - GAUGE_POLICIES.keys() == set()


def test_an_unknown_gauge_is_summed() -> None:
    registries = [CollectorRegistry() for _ in range(3)]
    for n, registry in enumerate(registries):
        Gauge("pdr_new_amount_bytes", "a gauge the table does not name", registry=registry).set(
            n + 1
        )
    merged = merge_expositions([generate_latest(r).decode() for r in registries])
    assert value(merged, "pdr_new_amount_bytes") == 1 + 2 + 3


def test_info_is_the_same_everywhere() -> None:
    registries = [CollectorRegistry() for _ in range(3)]
    for registry in registries:
        PlatformCollector(registry=registry)
    texts = [generate_latest(r).decode() for r in registries]
    merged = merge_expositions(texts)
    assert samples(merged) == samples(texts[0])  # python_info stays 1, not 3


@pytest.fixture
def child() -> Iterator[int]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ProcessCollector reads /proc")
def test_process_metrics_of_two_real_processes(child: int) -> None:
    registries = [CollectorRegistry(), CollectorRegistry()]
    for registry, pid in zip(registries, (os.getpid(), child), strict=True):
        ProcessCollector(pid=functools.partial(int, pid), registry=registry)
    texts = [generate_latest(r).decode() for r in registries]
    merged = merge_expositions(texts)
    each = [samples(t) for t in texts]
    for name, combine in (
        ("process_start_time_seconds", min),
        ("process_max_fds", max),
        ("process_open_fds", sum),
        ("process_resident_memory_bytes", sum),
        ("process_cpu_seconds_total", sum),
    ):
        assert value(merged, name) == combine(s[(name, ())] for s in each), name
    assert each[0][("process_start_time_seconds", ())] < each[1][("process_start_time_seconds", ())]
