"""Overload degrades instead of collapsing (issue 11, item 6; requirement 3).

Admission control (``--max-concurrent-requests``, a bounded FIFO wait queue with a timeout: 429
with ``Retry-After`` beyond it), per-worker in-flight caps, and the capacity back-off from an
engine that answered it is full (avoided for a moment, never marked unhealthy). Real router and
fake engines on 127.0.0.1; requests are held open with a decode that hangs until its client
leaves.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from router.errors import Overloaded, WorkersBusy
from router.pipeline.admission import AdmissionGate
from router.server.cli import parse_args
from router.settings import AdmissionSettings
from router.workers import Role, Worker, WorkerPool
from testkit.fake_base import Admission, Call, EngineError
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeEngine
from testkit.polling import await_until

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
WAIT_S = 10.0  # deadline of every poll


def metric(cluster: FakeCluster, name: str, labels: str = "") -> float:
    """One sample of the router's /metrics (``labels``: as rendered, e.g. ``reason="x"``)."""
    text = httpx.get(cluster.router_url + "/metrics", timeout=5).text
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    raise AssertionError(f"{wanted} not in /metrics")


def rejected(cluster: FakeCluster, reason: str) -> float:
    return metric(cluster, "pdr_admission_rejected_total", f'reason="{reason}"')


async def settle(cluster: FakeCluster, *, inflight: int, queued: int) -> None:
    def there() -> bool:
        return (
            metric(cluster, "pdr_requests_inflight") == inflight
            and metric(cluster, "pdr_admission_queue_depth") == queued
        )

    await await_until(there, WAIT_S, f"{inflight} requests in flight and {queued} queued")


def assert_shed(response: httpx.Response, status: int = 429) -> None:
    """An OpenAI-style error telling the client to come back."""
    assert response.status_code == status, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    if status == 429:
        assert error["type"] == "rate_limit_exceeded"


async def hang_up(tasks: list[asyncio.Task[Any]]) -> None:
    """The clients of these requests disconnect."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def post(client: httpx.AsyncClient, **extra: Any) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(client.post("/v1/completions", json={**COMPLETION, **extra}))


def kv_pool(engine: FakeEngine, slots: int) -> None:
    """The engine holds ``slots`` requests at once; beyond that it answers 503 "KV pool full",
    as SGLang does when its KV pool cannot take a request."""
    admit: Callable[[Call], Awaitable[Admission]] = engine.handler.admit

    async def limited(call: Call) -> Admission:
        if engine.inflight > slots:  # counts this request too
            raise EngineError(503, "KV pool full")
        return await admit(call)

    engine.handler.admit = limited  # type: ignore[method-assign]


# --------------------------------------------------------------------------- the gate


async def test_beyond_the_queue_a_request_gets_429_with_retry_after_at_once(
    make_cluster: FakeClusterFactory,
) -> None:
    admission = {"max_concurrent_requests": 2, "max_queued_requests": 1}
    cluster = make_cluster("vllm-nixl", admission=admission)
    decode = cluster.decodes[0]
    decode.config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        held = [post(client) for _ in range(3)]
        await settle(cluster, inflight=2, queued=1)
        await await_until(lambda: decode.inflight == 2, WAIT_S, "two requests at the decode")
        started = time.monotonic()
        response = await client.post("/v1/completions", json=COMPLETION)
        elapsed = time.monotonic() - started
        assert_shed(response)
        assert elapsed < 2.0
        assert not any(task.done() for task in held)
        await hang_up(held)
    assert rejected(cluster, "queue_full") == 1
    await settle(cluster, inflight=0, queued=0)
    assert len(decode.records) == 2


async def test_a_request_queued_past_the_timeout_gets_429(
    make_cluster: FakeClusterFactory,
) -> None:
    admission = {"max_concurrent_requests": 1, "queue_timeout_s": 0.3}
    cluster = make_cluster("sglang", admission=admission)
    cluster.decodes[0].config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        held = [post(client)]
        await settle(cluster, inflight=1, queued=0)
        started = time.monotonic()
        response = await client.post("/v1/completions", json=COMPLETION)
        elapsed = time.monotonic() - started
        assert_shed(response)
        assert "waited 0.3s" in response.json()["error"]["message"]
        assert 0.3 <= elapsed < 3.0
        await settle(cluster, inflight=1, queued=0)
        await hang_up(held)
    assert rejected(cluster, "queue_timeout") == 1
    await settle(cluster, inflight=0, queued=0)


async def test_a_queued_client_that_disconnects_frees_its_place(
    make_cluster: FakeClusterFactory,
) -> None:
    admission = {"max_concurrent_requests": 1, "max_queued_requests": 1}
    cluster = make_cluster("vllm-nixl", admission=admission)
    decode = cluster.decodes[0]
    decode.config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        first = post(client)
        await settle(cluster, inflight=1, queued=0)
        decode.config.hang = False  # requests admitted from now on are answered
        leaving = post(client)
        await settle(cluster, inflight=1, queued=1)
        await hang_up([leaving])
        await settle(cluster, inflight=1, queued=0)
        last = post(client)  # the place is free: it queues (a full queue would answer 429)
        await settle(cluster, inflight=1, queued=1)
        await hang_up([first])  # its slot passes to the oldest waiter
        response = await last
    assert response.status_code == 200
    assert rejected(cluster, "queue_full") == 0
    assert len(decode.records) == 2  # the one that left never reached an engine
    await settle(cluster, inflight=0, queued=0)


async def test_slots_come_back_on_every_path(make_cluster: FakeClusterFactory) -> None:
    """Streams that end, break mid-way, or whose client leaves; plain answers; all through a
    queue: the in-flight count is back at zero and the next request is served."""
    admission = {"max_concurrent_requests": 3, "max_queued_requests": 32}
    cluster = make_cluster("sglang", decode=2, admission=admission)
    for decode in cluster.decodes:
        decode.config.token_delay = 0.01
    cluster.decodes[1].config.fail_after_events = 2  # its streams break

    async def leave_mid_stream(client: httpx.AsyncClient) -> None:
        body = {**COMPLETION, "stream": True, "max_tokens": 16}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                return  # the first chunk, then hang up

    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        calls = [post(client, stream=True) for _ in range(6)]
        calls += [post(client) for _ in range(4)]
        leavers = [asyncio.create_task(leave_mid_stream(client)) for _ in range(3)]
        responses = await asyncio.gather(*calls)
        await asyncio.gather(*leavers)
        broken = [r for r in responses if r.status_code == 200 and '"error"' in r.text]
        assert broken, "no stream broke: the error path went untested"
        assert all(r.status_code == 200 for r in responses)
        await settle(cluster, inflight=0, queued=0)
        again = await client.post("/v1/completions", json=COMPLETION)
    assert again.status_code == 200
    cluster.wait_idle()


# --------------------------------------------------------------------------- worker caps


def held_at(engine: FakeEngine, requests: int) -> bool:
    """The engine got ``requests`` requests, and the last is still open."""
    return len(engine.records) == requests and not engine.records[-1].done


async def test_a_worker_at_its_cap_is_no_candidate(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("vllm-nixl", decode=2, admission={"max_inflight_per_decode": 1})
    busy, free = cluster.decodes
    busy.config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        held = [post(client)]  # round robin: the first decode, where it stays
        await await_until(lambda: held_at(busy, 1), WAIT_S, "a request held at decode 0")
        # round robin alone would send every second request to the held decode (and hang)
        for _ in range(4):
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert (len(busy.records), len(free.records)) == (1, 4)
        free.config.hang = True
        held.append(post(client))
        await await_until(lambda: held_at(free, 5), WAIT_S, "a request held at decode 1")
        response = await client.post("/v1/completions", json=COMPLETION)
        assert_shed(response)  # every decode at its cap: 429 at once
        assert "every decode worker is at its limit of 1" in response.json()["error"]["message"]
        assert cluster.ready_body()["status"] == "ready"  # busy is not unhealthy
        await hang_up(held)
    assert rejected(cluster, "worker_cap") == 1
    cluster.wait_idle()


def test_per_role_caps_fall_back_to_the_per_worker_cap() -> None:
    settings = AdmissionSettings(max_inflight_per_worker=8, max_inflight_per_decode=2)
    assert settings.worker_caps() == (8, 2)
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False, caps=settings.worker_caps())
    workers = [Worker(Role.DECODE, f"http://127.0.0.1:{9000 + i}", healthy=True) for i in (0, 1)]
    for worker in workers:
        pool.add(worker, None)
    workers[0].inflight = 2
    assert pool.available_decode() == [workers[1]]
    workers[1].inflight = 2
    with pytest.raises(WorkersBusy):
        pool.available_decode()
    assert pool.ready() is False  # no prefill; a busy decode alone does not make it unready
    assert pool.usable_decode() == workers


# --------------------------------------------------------------------------- back-off


def test_a_full_worker_is_avoided_for_the_back_off_window(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang", prefill=2, health={"failure_threshold": 2})
    full = cluster.prefills[0]
    full.config.fail_status = 503
    started = time.monotonic()
    with cluster.client() as client:
        statuses = [client.post("/v1/completions", json=COMPLETION).status_code for _ in range(20)]
    elapsed = time.monotonic() - started
    assert statuses == [200] * 20
    # round robin alone would start 10 of them there; back-off: one try per 1 s window
    assert 1 <= len(full.records) <= 1 + math.ceil(elapsed)
    body = cluster.ready_body()
    assert [w["healthy"] for w in body["prefill"]] == [True, True]


def test_the_back_off_ends_and_the_worker_gets_requests_again(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl", prefill=2, admission={"capacity_backoff_s": 0.3})
    full = cluster.prefills[0]
    full.config.fail_status = 503
    with cluster.client() as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        assert len(full.records) == 1
        full.config.fail_status = None  # it has room again
        deadline = time.monotonic() + WAIT_S
        while len(full.records) < 2 and time.monotonic() < deadline:
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert len(full.records) >= 2 and full.records[-1].status == 200


# --------------------------------------------------------------------------- overload


async def _storm(
    cluster: FakeCluster, clients: int, each: int, duration_s: float = 60.0
) -> tuple[list[httpx.Response], float]:
    """``clients`` concurrent clients sending up to ``each`` requests back to back (ignoring
    Retry-After, as in the issue), for at most ``duration_s``."""
    deadline = time.monotonic() + duration_s

    async def one_client(client: httpx.AsyncClient) -> list[httpx.Response]:
        responses: list[httpx.Response] = []
        while len(responses) < each and time.monotonic() < deadline:
            responses.append(await client.post("/v1/completions", json=COMPLETION))
        return responses

    started = time.monotonic()
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30, limits=limits) as c:
        results = await asyncio.gather(*(one_client(c) for _ in range(clients)))
    return [r for responses in results for r in responses], time.monotonic() - started


def _overloaded(make_cluster: FakeClusterFactory, **admission: Any) -> FakeCluster:
    """The issue's shape, small: two prefills that each hold one request (50 ms each); beyond
    that they answer 503 "KV pool full"."""
    cluster = make_cluster("sglang", prefill=2, admission=admission)
    for prefill in cluster.prefills:
        prefill.config.headers_delay = 0.05
        kv_pool(prefill, 1)
    return cluster


async def test_overload_sheds_with_retry_after_and_keeps_workers_healthy(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = _overloaded(make_cluster)
    # 3 s: the full suite on 2 cores once saw 8 successes in 1.5 s (the shed answers are cheap,
    # so the 8 clients keep the router and the fakes busy)
    responses, elapsed = await _storm(cluster, clients=8, each=400, duration_s=3.0)
    ok = [r for r in responses if r.status_code == 200]
    shed = [r for r in responses if r.status_code != 200]
    # two slots of 50 ms: ~40 successes a second at best; the issue saw 8 in 15 s
    assert len(ok) >= 10, f"{len(ok)} successes, {len(shed)} shed in {elapsed:.1f}s"
    for response in shed:  # the engine's 503 with Retry-After: never "no healthy worker"
        assert_shed(response, 503)
        assert "KV pool full" in response.json()["error"]["message"]
    body = cluster.ready_body()
    assert [w["healthy"] for w in body["prefill"]] == [True, True]
    cluster.wait_idle()


async def test_overload_queues_when_the_caps_match_the_engines(
    make_cluster: FakeClusterFactory,
) -> None:
    """Two request slots, one per prefill: every client waits its turn and is served."""
    cluster = _overloaded(
        make_cluster,
        max_concurrent_requests=2,
        max_queued_requests=16,
        max_inflight_per_prefill=1,
    )
    responses, elapsed = await _storm(cluster, clients=8, each=5)
    assert [r.status_code for r in responses] == [200] * 40
    full = sum(1 for p in cluster.prefills for r in p.records if r.status == 503)
    assert full <= 4, f"{full} KV-pool-full answers: the caps did not keep requests away"
    assert elapsed < 20
    await settle(cluster, inflight=0, queued=0)


# --------------------------------------------------------------------------- the gate alone


async def test_the_queue_is_fifo_and_a_slot_handed_to_a_leaver_passes_on() -> None:
    gate = AdmissionGate(AdmissionSettings(max_concurrent_requests=1, max_queued_requests=3))
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    await gate.acquire(never)
    order: list[str] = []

    async def wait(name: str) -> None:
        await gate.acquire(never)
        order.append(name)

    first, second, third = (asyncio.create_task(wait(n)) for n in ("a", "b", "c"))
    await await_until(lambda: gate.queued == 3, WAIT_S, "three waiters")
    with pytest.raises(Overloaded):
        await gate.acquire(never)
    gate.release()  # hands the slot to "a" ...
    first.cancel()  # ... which is cancelled before it runs: the slot must reach "b"
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert order == ["b"] and gate.inflight == 1
    gate.release()
    await third
    gate.release()
    assert order == ["b", "c"] and (gate.inflight, gate.queued) == (0, 0)
    never.cancel()


def test_the_flags_set_the_admission_settings() -> None:
    settings = parse_args(
        [
            *("--max-concurrent-requests", "4", "--max-queued-requests", "0"),
            *("--queue-timeout", "2.5", "--max-inflight-per-worker", "3"),
            *("--max-inflight-per-decode", "2", "--capacity-backoff", "0"),
        ]
    ).admission
    assert (settings.max_concurrent_requests, settings.max_queued_requests) == (4, 0)
    assert (settings.queue_timeout_s, settings.capacity_backoff_s) == (2.5, 0.0)
    assert settings.worker_caps() == (3, 2)
