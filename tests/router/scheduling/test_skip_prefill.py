"""Skipping the prefill leg: a vLLM decode prefills locally when a KV transfer is not worth it.

Few uncached prompt tokens, or every prefill saturated: the decode alone gets the client's body,
unchanged. SGLang never skips (its decode cannot prefill).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from router import create_app
from router.adapters import VllmNixlAdapter
from router.observability.metrics import RouterMetrics
from router.scheduling.chooser import RouteChooser
from router.scheduling.features import Featurizer
from router.scheduling.policies import build_policy
from router.settings import CacheAwareSettings
from router.upstream.base import UpstreamPool
from router.workers import EngineLoad, Role, Worker
from testkit.fake_cluster import FakeClusterFactory, settings_for
from testkit.fake_engine import FakeEngine
from testkit.polling import await_until
from testkit.servers import arun_server, run_servers

MODEL = "fake-model"
SHORT = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "min_tokens": 2}
LONG = {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 4}  # ~2,500 estimated tokens
FEW = {"pd_min_uncached_tokens": 1000}


def sse_data(text: str) -> list[Any]:
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else msgspec.json.decode(e) for e in events]


async def test_few_uncached_tokens_go_to_the_decode_alone_unchanged(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake", cache=FEW)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=10) as client:
        response = await client.post("/v1/completions", json=SHORT)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        streamed = await client.post("/v1/completions", json={**SHORT, "stream": True})
        assert streamed.status_code == 200 and sse_data(streamed.text)[-1] == "[DONE]"
        assert cluster.prefills[0].records == []
        bodies = [record.body for record in cluster.decodes[0].records]
        assert bodies == [SHORT, {**SHORT, "stream": True}]  # no kv_transfer_params, min_tokens
        long = await client.post("/v1/completions", json=LONG)
        assert long.status_code == 200, long.text
        assert len(cluster.prefills[0].records) == 1  # worth a transfer: the PD path
        assert "kv_transfer_params" in cluster.decodes[0].records[-1].body
        metrics = (await client.get("/metrics")).text
    skipped = 'outcome="skipped_few_uncached_tokens",policy="round_robin"'
    assert f"pdr_routing_decisions_total{{{skipped}}} 2.0" in metrics
    assert 'pdr_routing_decisions_total{outcome="round_robin",policy="round_robin"} 1.0' in metrics


async def test_sglang_never_skips_the_prefill(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", cache=FEW)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=10) as client:
        response = await client.post("/v1/completions", json=SHORT)
    assert response.status_code == 200, response.text
    assert len(cluster.prefills[0].records) == 1


def _saturated_prefill(waiting: int, metrics_reads: list[float]) -> Starlette:
    """A vLLM prefill that is healthy, reports ``waiting`` queued requests and must not be sent
    a request (it would answer 500)."""

    async def health(_: Request) -> PlainTextResponse:
        return PlainTextResponse("")

    async def metrics(_: Request) -> PlainTextResponse:
        metrics_reads.append(time.monotonic())
        labels = '{engine="0",model_name="fake-model"}'
        running = f"vllm:num_requests_running{labels} 4.0\n"
        return PlainTextResponse(running + f"vllm:num_requests_waiting{labels} {waiting}.0\n")

    async def completions(_: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": "saturated prefill was called"}}, 500)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


async def test_saturated_prefills_are_skipped() -> None:
    reads: list[float] = []
    decode = FakeEngine("decode", "vllm-nixl")
    async with arun_server(_saturated_prefill(9, reads)) as prefill_port:
        with run_servers(decode.app) as (decode_port,):
            settings = settings_for(
                "vllm-nixl",
                [(f"http://127.0.0.1:{prefill_port}", None)],
                [f"http://127.0.0.1:{decode_port}"],
                load={"interval_s": 0.05},
                cache={"prefill_saturated_waiting": 5},
            )
            async with arun_server(create_app(settings)) as router_port:
                await await_until(lambda: len(reads) >= 3, 10, "two full load reads")
                async with httpx.AsyncClient(timeout=10) as client:
                    url = f"http://127.0.0.1:{router_port}/v1/completions"
                    response = await client.post(url, json=LONG)
                    metrics = (await client.get(f"http://127.0.0.1:{router_port}/metrics")).text
    assert response.status_code == 200, response.text
    assert [record.body for record in decode.records] == [LONG]
    assert (
        'pdr_routing_decisions_total{outcome="skipped_prefills_saturated",policy="round_robin"} 1.0'
        in metrics
    )


def _chooser(saturated_at: int) -> RouteChooser:
    return RouteChooser(
        UpstreamPool(needs_engine_ids=False),
        VllmNixlAdapter().decode_can_prefill,
        build_policy("round_robin"),
        build_policy("round_robin"),
        RouterMetrics(),
        CacheAwareSettings(prefill_saturated_waiting=saturated_at),
        Featurizer(None),
    )


def _reporting(waiting: float | None) -> Worker:
    worker = Worker(Role.PREFILL, "http://127.0.0.1:1")
    if waiting is not None:
        loads: list[EngineLoad | None] = [EngineLoad(running=1, waiting=waiting)]
        worker.record_engine_load(loads, at=time.monotonic(), stale_after=60, dispatched=[0])
    return worker


def test_saturation_needs_every_prefill_to_report_a_full_queue() -> None:
    chooser = _chooser(5)
    assert chooser.saturated([_reporting(5), _reporting(7)])
    assert not chooser.saturated([_reporting(5), _reporting(4)])
    assert not chooser.saturated([_reporting(9), _reporting(None)])  # unknown is not full
    assert not chooser.saturated([])
