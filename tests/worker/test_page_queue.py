"""A pd-worker whose KV pool is short queues the request, as vLLM and SGLang do.

One co-located worker (``--role both``) with a 64-page pool (1,024 tokens) and a simulated
forward time, so that a request holds its pages for a known while: a request that does not fit
waits in a first-come-first-served line and is served when pages come back; it is refused only
when the line is full or it waited too long (503, SGLang's messages); a prompt larger than the
whole pool is a 400 at once. The line (``worker.page_queue``) shows in the load signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testkit.polling import await_until
from testkit.servers import run_server
from worker.app import SimWorker, WorkerConfig, create_app
from worker.kv import PoolShape

SHAPE = PoolShape(layers=2, page_size=16, bytes_per_token=64, pages=64)
S_PER_TOKEN = 0.0015  # a 960-token prompt holds its 60 pages for ~1.4 s


@contextlib.contextmanager
def serving(**options: Any) -> Iterator[tuple[SimWorker, str]]:
    config = WorkerConfig(
        "both", shape=SHAPE, compute_s_per_token=S_PER_TOKEN, **{"protocol": "sglang", **options}
    )
    worker = SimWorker(config, None)
    with run_server(create_app(worker)) as port:
        yield worker, f"http://127.0.0.1:{port}"


async def _complete(client: httpx.AsyncClient, url: str, tokens: int) -> httpx.Response:
    body = {"model": "sim-model", "prompt": "q" * tokens, "max_tokens": 4}
    return await client.post(f"{url}/v1/completions", json=body, timeout=20.0)


async def _holding(client: httpx.AsyncClient, worker: SimWorker, url: str, tokens: int) -> Any:
    """A request that takes ``tokens`` of the pool and computes for a while; returns its task
    once it holds its pages."""
    task = asyncio.create_task(_complete(client, url, tokens))
    await await_until(lambda: worker.pool.free_pages < SHAPE.pages, 5.0, "pages held")
    return task


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("protocol", ["sglang", "vllm-mooncake"])
async def test_a_request_that_does_not_fit_waits_first_come_first_served(protocol: str) -> None:
    with serving(protocol=protocol) as (worker, url):
        async with httpx.AsyncClient() as client:
            big = await _holding(client, worker, url, 960)  # 60 of 64 pages
            waiting = asyncio.create_task(_complete(client, url, 480))  # 30 pages: waits
            await await_until(lambda: worker.waiting_for_pages == 1, 5.0, "a request in line")
            small = asyncio.create_task(_complete(client, url, 32))  # fits in the 4 free pages
            await await_until(lambda: worker.waiting_for_pages == 2, 5.0, "behind the first")
            assert not big.done() and not small.done()  # it did not overtake the waiting one
            metrics = (await client.get(f"{url}/metrics")).text
            health = (await client.get(f"{url}/health")).json()
            answers = await asyncio.gather(big, waiting, small)
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert health["waiting_for_pages"] == 2
    if protocol == "sglang":
        assert _metric(metrics, "sglang:num_queue_reqs") == 2
        assert _metric(metrics, "sglang:num_running_reqs") == 1
    else:
        assert _metric(metrics, "vllm:num_requests_waiting") == 2
        assert _metric(metrics, "vllm:num_requests_running") == 1
    assert worker.pool.free_pages == SHAPE.pages and worker.waiting_for_pages == 0


async def test_a_full_line_is_503_and_a_prompt_larger_than_the_pool_400_at_once() -> None:
    with serving(max_queued_requests=1) as (worker, url):
        async with httpx.AsyncClient() as client:
            big = await _holding(client, worker, url, 960)
            waiting = asyncio.create_task(_complete(client, url, 480))
            await await_until(lambda: worker.waiting_for_pages == 1, 5.0, "a request in line")
            started = time.monotonic()
            full = await _complete(client, url, 16)
            never = await _complete(client, url, SHAPE.pages * SHAPE.page_size + 1)
            refused_s = time.monotonic() - started
            assert not big.done()  # both answered while the pool was still held
            answers = await asyncio.gather(big, waiting)
    assert full.status_code == 503, full.text
    assert full.json()["error"]["message"] == "The request queue is full."
    assert never.status_code == 400, never.text
    assert refused_s < 1.0
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert worker.ranks[0].queue.rejected_full == 1


async def test_a_request_that_waits_past_the_waiting_timeout_is_503() -> None:
    with serving(waiting_timeout_s=0.3) as (worker, url):
        async with httpx.AsyncClient() as client:
            big = await _holding(client, worker, url, 960)
            started = time.monotonic()
            late = await _complete(client, url, 480)
            waited_s = time.monotonic() - started
            assert not big.done()
            assert (await big).status_code == 200
    assert late.status_code == 503, late.text
    assert late.json()["error"]["message"] == "Request waiting timeout reached."
    assert 0.3 <= waited_s < 1.2
    assert worker.pool.free_pages == SHAPE.pages and worker.waiting_for_pages == 0
