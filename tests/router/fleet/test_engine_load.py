"""Engine load: the engines' own reports (vLLM /metrics, SGLang /v1/loads or /metrics) read over
real sockets, credited with what this router sent since, and unknown (never idle) when missing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.fleet.engine_load import (
    EngineLoadMonitor,
    LoadUnavailable,
    fit_ranks,
    parse_sglang_loads,
    parse_sglang_metrics,
    parse_vllm_metrics,
)
from router.scheduling.policies import build_policy, least_loaded_rank
from router.settings import EngineProtocol, LoadSettings
from router.workers import EngineLoad, Role, Worker, WorkerPool
from testkit.polling import await_until
from testkit.servers import arun_server, free_port

# vLLM 0.32 /metrics of a DP=2 engine (names, help text and labels from
# vllm/v1/metrics/loggers.py; the text as prometheus_client writes it), trimmed.
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18234.0
python_gc_objects_collected_total{generation="1"} 4117.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.5133056e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: \
'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints \
(LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="deferred"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="Qwen/Qwen3-0.6B",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 \
means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep \
level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="Qwen/Qwen3-0.6B",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="1",model_name="Qwen/Qwen3-0.6B",sleep_state="awake"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.41
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 12800.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 4096.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7695e+09
vllm:prefix_cache_queries_created{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.7695e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 9600.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 1024.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.3
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.03
"""

# SGLang 0.5.23 /metrics of a DP=2 prefill (--enable-metrics; labels from
# metrics_collector.py; multiprocess mode, so no _created samples), trimmed.
SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 4.0
sglang:num_running_reqs{dp_rank="1",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 7.0
sglang:num_queue_reqs{dp_rank="1",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:num_grammar_queue_reqs The number of requests in the grammar waiting queue.
# TYPE sglang:num_grammar_queue_reqs gauge
sglang:num_grammar_queue_reqs{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.62
sglang:token_usage{dp_rank="1",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.05
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.33
# HELP sglang:num_prefill_inflight_queue_reqs The number of requests in the prefill inflight queue.
# TYPE sglang:num_prefill_inflight_queue_reqs gauge
sglang:num_prefill_inflight_queue_reqs{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 51234.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{dp_rank="0",engine_type="prefill",le="0.1",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 10.0
sglang:time_to_first_token_seconds_bucket{dp_rank="0",engine_type="prefill",le="+Inf",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 12.0
sglang:time_to_first_token_seconds_count{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 12.0
sglang:time_to_first_token_seconds_sum{dp_rank="0",engine_type="prefill",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.9
"""  # noqa: E501 - real exposition lines

# SGLang 0.5.23 GET /v1/loads (entrypoints/v1_loads.py; each entry LoadSnapshot.to_dict()).
SGLANG_LOADS = {
    "timestamp": "2026-02-11T09:30:12.481220+00:00",
    "version": "0.5.23",
    "accelerator": None,
    "num_accelerators": 1,
    "loads": [
        {
            "timestamp": 1770802212.47,
            "dp_rank": rank,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 812,
            "num_used_tokens": 9310,
            "num_total_tokens": 9310,
            "num_active_tokens": 9310,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": 120000,
            "max_running_requests": 2048,
            "token_usage": usage,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.18,
            "utilization": 0.4,
            "total_prefill_uncached_tokens": 88211,
            "total_prefill_busy_us": 912000,
            "decode_moments": None,
            "memory": {"weight_gb": 1.1, "kv_cache_gb": 9.6, "graph_gb": 0.0, "token_capacity": 1},
            "disaggregation": {"mode": "prefill", "prefill_bootstrap_queue_reqs": 1},
            "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0},
        }
        for rank, running, waiting, usage in ((0, 5, 2, 0.5), (1, 0, 0, 0.0))
    ],
}


def test_vllm_metrics_give_each_dp_engine_its_own_load() -> None:
    assert parse_vllm_metrics(VLLM_METRICS) == {
        0: EngineLoad(running=3, waiting=2, kv_usage=0.41),
        1: EngineLoad(running=1, waiting=0, kv_usage=0.125),
    }


def test_vllm_series_of_one_engine_are_summed_over_model_names() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="base"} 2\n'
        'vllm:num_requests_running{engine="0",model_name="adapter"} 3\n'
        'vllm:num_requests_waiting{engine="0",model_name="base"} 1\n'
        'vllm:num_requests_waiting{engine="0",model_name="adapter"} 4\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="adapter"} 0.7\n'
    )
    assert parse_vllm_metrics(text) == {0: EngineLoad(running=5, waiting=5, kv_usage=0.7)}


@pytest.mark.parametrize("separator", [":", "_"])
def test_sglang_metrics_with_either_prefix(separator: str) -> None:
    text = SGLANG_METRICS.replace("sglang:", f"sglang{separator}")
    assert parse_sglang_metrics(text) == {
        0: EngineLoad(running=4, waiting=7, kv_usage=0.62),
        1: EngineLoad(running=0, waiting=1, kv_usage=0.05),
    }


def test_sglang_v1_loads_gives_each_dp_rank_its_own_load() -> None:
    assert parse_sglang_loads(json.dumps(SGLANG_LOADS).encode()) == {
        0: EngineLoad(running=5, waiting=2, kv_usage=0.5),
        1: EngineLoad(running=0, waiting=0, kv_usage=0.0),
    }


# An SGLang decode: its waiting queue holds requests whose KV arrived; those still waiting for
# pages are its prealloc queue (waiting too), those receiving KV its transfer queue (not counted).
SGLANG_DECODE_METRICS = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="decode",model_name="qwen"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="decode",model_name="qwen"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="decode",model_name="qwen"} 0.97
# TYPE sglang:num_decode_prealloc_queue_reqs gauge
sglang:num_decode_prealloc_queue_reqs{dp_rank="0",engine_type="decode",model_name="qwen"} 4.0
# TYPE sglang:num_decode_transfer_queue_reqs gauge
sglang:num_decode_transfer_queue_reqs{dp_rank="0",engine_type="decode",model_name="qwen"} 2.0
"""
SGLANG_DECODE_LOADS = {
    "loads": [
        {
            "dp_rank": 0,
            "num_running_reqs": 3,
            "num_waiting_reqs": 1,
            "token_usage": 0.97,
            "disaggregation": {
                "mode": "decode",
                "decode_prealloc_queue_reqs": 4,
                "decode_transfer_queue_reqs": 2,
                "decode_retracted_queue_reqs": 0,
            },
        }
    ]
}


@pytest.mark.parametrize("separator", [":", "_"])
def test_sglang_decode_counts_requests_waiting_for_pages_as_waiting(separator: str) -> None:
    expected = {0: EngineLoad(running=3, waiting=5, kv_usage=0.97)}
    text = SGLANG_DECODE_METRICS.replace("sglang:", f"sglang{separator}")
    assert parse_sglang_metrics(text) == expected
    assert parse_sglang_loads(json.dumps(SGLANG_DECODE_LOADS).encode()) == expected
    # the prealloc queue alone is not a load: without the waiting queue the rank is unknown
    without_queue = "\n".join(
        line for line in SGLANG_DECODE_METRICS.splitlines() if "num_queue_reqs" not in line
    )
    assert parse_sglang_metrics(without_queue) == {0: None}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ([{"num_running_reqs": 2, "num_waiting_reqs": 1}], {0: EngineLoad(2, 1)}),
        ({"num_running_reqs": 2, "num_queue_reqs": 6}, {0: EngineLoad(2, 6)}),
        ({"dp_rank": 3, "num_running_reqs": 1, "num_waiting_reqs": 0}, {3: EngineLoad(1, 0)}),
        (
            {"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0}, {"num_running_reqs": 2}]},
            {0: EngineLoad(1, 0), 1: None},  # the second rank lacks its waiting count
        ),
    ],
)
def test_sglang_v1_loads_other_shapes(answer: object, expected: dict[int, object]) -> None:
    assert parse_sglang_loads(json.dumps(answer).encode()) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html>502 Bad Gateway</html>",
        'vllm:num_requests_running{engine="0" 3\n',  # truncated
        'vllm:num_requests_running{engine="x"} 3\nvllm:num_requests_waiting{engine="x"} 0\n',
        # the names vLLM removed (vllm PR #29330): a reader of them would see 0, i.e. idle
        'vllm:gpu_cache_usage_perc{engine="0"} 0.9\nvllm:num_preemptions_total{engine="0"} 2\n',
    ],
)
def test_vllm_metrics_without_the_gauges_are_unknown_not_idle(text: str) -> None:
    with pytest.raises(LoadUnavailable):
        parse_vllm_metrics(text)


def test_a_rank_missing_a_gauge_is_unknown() -> None:
    text = VLLM_METRICS.replace('vllm:num_requests_waiting{engine="1"', 'other{engine="1"')
    assert parse_vllm_metrics(text)[1] is None
    assert fit_ranks(parse_vllm_metrics(text), 1) == [None]  # a total with an unknown part


@pytest.mark.parametrize(
    "content",
    [b'{"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 90}', b"[]", b"not json", b'"ok"'],
)
def test_sglang_v1_loads_without_the_counts_are_unknown(content: bytes) -> None:
    with pytest.raises(LoadUnavailable):
        parse_sglang_loads(content)


def test_engine_indexes_map_onto_the_workers_dp_ranks() -> None:
    a, b = EngineLoad(1, 2, 0.25), EngineLoad(3, 4, 0.5)
    assert fit_ranks({0: a, 1: b}, 2) == [a, b]
    assert fit_ranks({2: a, 3: b}, 2) == [a, b]  # an engine serving DP ranks 2 and 3
    assert fit_ranks({0: a, 1: b}, 1) == [EngineLoad(4, 6, 0.5)]  # one rank: the total
    assert fit_ranks({0: a}, 2) == [a, None]  # one series: rank 0


# --- the worker: readings, credits, staleness -----------------------------------------------


def _prefill(dp_size: int = 1, url: str = "http://127.0.0.1:1") -> Worker:
    worker = Worker(Role.PREFILL, url)
    worker.set_layout(dp_size)
    return worker


def _record(worker: Worker, *loads: EngineLoad | None, age: float = 0.0) -> None:
    worker.record_engine_load(
        list(loads),
        at=time.monotonic() - age,
        stale_after=5.0,
        dispatched=list(worker.rank_dispatched),
    )


def test_requests_sent_since_a_reading_are_credited_until_the_next() -> None:
    worker = _prefill()
    _record(worker, EngineLoad(0, 0))
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(worker.load(0))
    assert worker.inflight == 0
    assert worker.load_score(0) == worker.load_score() == 3.0  # sent, not yet in a report
    _record(worker, EngineLoad(running=1, waiting=1))
    assert worker.load_score(0) == 2.0  # the new report counts them itself


def test_engine_load_outweighs_the_routers_inflight_count() -> None:
    worker = _prefill()
    with worker.load(0):
        _record(worker, EngineLoad(running=6, waiting=4, kv_usage=0.9))
        assert worker.load_score() == 10.0
        assert worker.engine_waiting() == 4.0
        assert worker.engine_load_known()


def test_stale_or_failed_readings_fall_back_to_inflight_counts() -> None:
    worker = _prefill()
    with worker.load(0):
        _record(worker, EngineLoad(running=6, waiting=4), age=6.0)  # older than stale_after
        assert worker.load_score() == worker.load_score(0) == 1.0
        assert worker.engine_waiting() is None
        assert not worker.engine_load_known()
        _record(worker, EngineLoad(running=6, waiting=4))
        worker.forget_engine_load()
        assert worker.load_score() == 1.0
        assert not worker.engine_load_known()


def test_worker_total_needs_every_rank_known() -> None:
    worker = _prefill(dp_size=2)
    with worker.load(1), worker.load(1):
        _record(worker, EngineLoad(2, 1), EngineLoad(0, 3))
        assert worker.load_score() == 2 + 1 + 0 + 3
        assert worker.engine_waiting() == 4.0
        assert worker.engine_waiting(1) == 3.0
        _record(worker, EngineLoad(2, 1), None)
        assert worker.load_score(0) == 3.0
        assert worker.load_score(1) == 2.0  # unknown rank: its in-flight requests
        assert worker.load_score() == 2.0  # unknown part: the whole worker's in-flight count
        assert worker.engine_waiting() is None and worker.engine_waiting(0) == 1.0
        assert worker.engine_load_known(0) and not worker.engine_load_known()


def test_least_loaded_rank_follows_the_engines_per_rank_load() -> None:
    worker = _prefill(dp_size=3)
    worker.rank_inflight[:] = [0, 0, 4]  # this router alone would pick rank 0 or 1
    _record(worker, EngineLoad(5, 0), EngineLoad(9, 9), EngineLoad(3, 1))
    assert [least_loaded_rank(worker) for _ in range(3)] == [2, 2, 2]
    with worker.load(2):  # 5 at rank 2 now: tied with rank 0
        assert {least_loaded_rank(worker) for _ in range(4)} == {0, 2}


# --- the monitor, over real sockets ---------------------------------------------------------


class _Engine:
    """A tiny engine answering its load endpoints from ``bodies`` (path -> body); ``mode``
    "error" answers 500, "hang" answers nothing until the test ends."""

    def __init__(self, bodies: dict[str, str]) -> None:
        self.bodies = bodies
        self.hits: Counter[str] = Counter()
        self.mode = "ok"
        self.release = asyncio.Event()
        self.app = Starlette(routes=[Route("/{path:path}", self._answer)])

    async def _answer(self, request: Request) -> Response:
        path = request.url.path
        self.hits[path] += 1
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "error":
            return Response("engine core died", status_code=500)
        body = self.bodies.get(path)
        return Response("Not Found", status_code=404) if body is None else Response(body)


@contextlib.asynccontextmanager
async def _serving(*engines: _Engine) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for engine in engines:
            port = await stack.enter_async_context(arun_server(engine.app, lifespan="off"))
            stack.callback(engine.release.set)  # runs before its server stops
            urls.append(f"http://127.0.0.1:{port}")
        yield urls


@contextlib.asynccontextmanager
async def _monitoring(
    pool: WorkerPool[None], engine: EngineProtocol, timeout_s: float = 2.0
) -> AsyncIterator[EngineLoadMonitor]:
    settings = LoadSettings(interval_s=0.02, timeout_s=timeout_s, stale_after_s=5.0)
    monitor = EngineLoadMonitor(pool, engine, settings)
    task = asyncio.create_task(monitor.run())
    try:
        yield monitor
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await monitor.aclose()


def _decode(url: str) -> Worker:
    return Worker(Role.DECODE, url)


def _vllm_metrics(running: int, waiting: int) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
    )


async def test_least_load_follows_the_engines_reported_load_not_inflight() -> None:
    busy = _Engine({"/metrics": _vllm_metrics(running=8, waiting=4)})
    idle = _Engine({"/metrics": _vllm_metrics(running=1, waiting=0)})
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    async with (
        _serving(busy, idle) as (busy_url, idle_url),
        _monitoring(pool, EngineProtocol.VLLM_NIXL),
    ):
        a, b = _decode(busy_url), _decode(idle_url)
        pool.add(a, None)
        with b.load(), b.load(), b.load():  # this router's own count favours the busy engine
            pool.add(b, None)  # joins while the monitor runs
            await await_until(
                lambda: a.engine_load_known() and b.engine_load_known(), 5.0, "both loads"
            )
            policy = build_policy("least_load")
            assert {policy.choose([a, b]) for _ in range(4)} == {b}
            assert b.load_score() == 1.0 and a.load_score() == 12.0


async def test_sglang_reads_v1_loads_and_falls_back_to_metrics_after_a_404() -> None:
    loads = _Engine({"/v1/loads": json.dumps(SGLANG_LOADS)})
    older = _Engine({"/metrics": SGLANG_METRICS.replace("sglang:", "sglang_")})
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    async with _serving(loads, older) as urls, _monitoring(pool, EngineProtocol.SGLANG):
        new_worker, old_worker = (_prefill(dp_size=2, url=url) for url in urls)
        pool.add(new_worker, None)
        pool.add(old_worker, None)
        await await_until(lambda: older.hits["/metrics"] >= 3, 5.0, "three /metrics reads")
        assert older.hits["/v1/loads"] == 1  # the fallback is remembered
        assert [new_worker.load_score(rank) for rank in (0, 1)] == [7.0, 0.0]
        assert [old_worker.load_score(rank) for rank in (0, 1)] == [11.0, 1.0]
        assert old_worker.engine_waiting() == 8.0
        assert [r.load.kv_usage for r in old_worker.engine_load if r] == [0.62, 0.05]


async def test_a_failing_engine_becomes_unknown_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.fleet.engine_load")
    engine = _Engine({"/metrics": _vllm_metrics(running=9, waiting=9)})
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    async with _serving(engine) as [url], _monitoring(pool, EngineProtocol.VLLM_MOONCAKE):
        worker = _decode(url)
        pool.add(worker, None)
        await await_until(worker.engine_load_known, 5.0, "the first reading")
        engine.mode = "error"
        with worker.load():
            await await_until(lambda: not worker.engine_load_known(), 5.0, "unknown load")
            assert worker.load_score() == 1.0  # in-flight, not the last report, not 0
            failed = engine.hits["/metrics"]
            await await_until(lambda: engine.hits["/metrics"] >= failed + 3, 5.0, "more reads")
        engine.mode = "ok"
        await await_until(worker.engine_load_known, 5.0, "known again")
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    transitions = [r.getMessage() for r in records]
    assert [("unknown" in m, "HTTP 500" in m) for m in transitions[-2:]] == [
        (True, True),
        (False, False),
    ]
    assert len(transitions) == 3, transitions  # known, unknown, known again: not every poll
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING, logging.INFO]


async def test_a_starting_engine_is_quiet_until_it_first_answers_then_failing_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="router.fleet.engine_load")
    engine = _Engine({"/metrics": _vllm_metrics(running=1, waiting=0)})
    port = free_port()
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)

    def loud() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]

    def refused() -> int:
        return sum("ConnectionRefusedError" in r.getMessage() for r in caplog.records)

    async with _monitoring(pool, EngineProtocol.VLLM_MOONCAKE):
        worker = _decode(f"http://127.0.0.1:{port}")
        pool.add(worker, None)  # nothing listens yet: the engine is still starting
        await await_until(lambda: refused() >= 3, 5.0, "three refused reads")
        assert loud() == []  # a starting engine is not a problem (DEBUG only)
        assert not worker.engine_load_known()
        async with arun_server(engine.app, port=port, lifespan="off"):
            await await_until(worker.engine_load_known, 5.0, "the first answer")
        before = refused()  # the engine went away after answering: a real problem
        await await_until(lambda: not worker.engine_load_known(), 5.0, "unknown again")
        await await_until(lambda: refused() >= before + 3, 5.0, "three more refused reads")
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [(r.levelno, "unknown" in r.getMessage()) for r in records] == [
        (logging.INFO, False),
        (logging.WARNING, True),
    ], loud()
    assert "GET /metrics failed" in records[1].getMessage()  # a refused connection, or a reset read


async def test_an_engine_hanging_past_the_timeout_is_unknown_while_others_are_read() -> None:
    hung = _Engine({"/metrics": _vllm_metrics(running=0, waiting=0)})
    healthy = _Engine({"/metrics": _vllm_metrics(running=2, waiting=0)})
    hung.mode = "hang"
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    async with (
        _serving(hung, healthy) as (hung_url, healthy_url),
        _monitoring(pool, EngineProtocol.VLLM_MOONCAKE, timeout_s=0.2),
    ):
        stuck, fine = _decode(hung_url), _decode(healthy_url)
        pool.add(stuck, None)
        pool.add(fine, None)
        await await_until(lambda: hung.hits["/metrics"] >= 2, 5.0, "a second try at the hung one")
        assert fine.engine_load_known() and fine.load_score() == 2.0
        assert not stuck.engine_load_known()
        with stuck.load():
            assert stuck.load_score() == 1.0  # unknown is never idle
