"""At the workers' in-flight caps, requests wait in the router's worker queue, most urgent first
and fair between tenants, instead of 429 or a place in an engine's first-come queue (issue 25:
the second stage of admission, ``--queue-at-worker-caps``).

The real router in front of fake engines on 127.0.0.1 (one prefill capped at one leg, held open
by a request whose client then leaves), then the queue alone against a worker pool whose counts
the test sets, to show that a free place is never promised twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.errors import WorkersBusy
from router.pipeline.admission_queue import Urgency
from router.pipeline.worker_queue import WorkerQueue, queue_at_caps
from router.settings import AdmissionSettings
from router.workers import Role, Worker, WorkerPool
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeEngine
from testkit.polling import await_until
from tests.router.pipeline.test_admission import (
    COMPLETION,
    assert_shed,
    hang_up,
    held_at,
    metric,
    rejected,
)

WAIT_S = 10.0
QUEUED = {"max_inflight_per_prefill": 1, "queue_at_worker_caps": True}


def ask(
    client: httpx.AsyncClient, prompt: str, headers: dict[str, str] | None = None
) -> asyncio.Task[httpx.Response]:
    body = {**COMPLETION, "prompt": prompt}
    return asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))


async def queued(cluster: FakeCluster, count: int) -> None:
    await await_until(
        lambda: metric(cluster, "pdr_worker_queue_depth") == count,
        WAIT_S,
        f"{count} requests waiting for a worker",
    )


async def hold_the_prefill(
    client: httpx.AsyncClient, prefill: FakeEngine
) -> list[asyncio.Task[httpx.Response]]:
    """One request holds the prefill's only place until its client leaves."""
    prefill.config.hang = True
    held = [ask(client, "held")]
    await await_until(lambda: held_at(prefill, 1), WAIT_S, "a request held at the prefill")
    prefill.config.hang = False  # those that come later answer
    return held


@dataclass
class Held:
    """A router whose one prefill (capped at one leg) a request holds; ``client`` talks to it."""

    cluster: FakeCluster
    prefill: FakeEngine
    client: httpx.AsyncClient
    held: list[asyncio.Task[httpx.Response]]


@contextlib.asynccontextmanager
async def held_prefill(make_cluster: FakeClusterFactory, **admission: Any) -> AsyncIterator[Held]:
    cluster = make_cluster("vllm-nixl", admission={**QUEUED, **admission})
    prefill = cluster.prefills[0]
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        yield Held(cluster, prefill, client, await hold_the_prefill(client, prefill))


def prompts(engine: FakeEngine) -> list[str]:
    return [record.body["prompt"] for record in engine.records]


async def test_at_the_cap_requests_wait_and_the_most_urgent_goes_first(
    make_cluster: FakeClusterFactory,
) -> None:
    async with held_prefill(make_cluster) as at:
        cluster, prefill, client, held = at.cluster, at.prefill, at.client, at.held
        waiting: list[asyncio.Task[httpx.Response]] = []
        for name, priority in (("batch-1", "1"), ("batch-2", "1"), ("interactive", "-1")):
            waiting.append(ask(client, name, {"x-priority": priority}))
            await queued(cluster, len(waiting))
        assert prompts(prefill) == ["held"]  # nobody passed the cap, nobody got 429
        status = (await client.get("/status/data")).json()

        by_band = {"high": 1, "normal": 0, "low": 2}
        assert status["admission"]["worker_queue"] == {"queued": 3, "queued_by_priority": by_band}
        explained = await client.post("/admin/explain", json=COMPLETION)  # priority 0
        assert explained.status_code == 200, explained.text  # at the caps: explained, not 429
        place = explained.json()["admission"]["worker_queue"]
        assert place == {"routed_at_once": False, "position": 1, "waiting": 3, "held_back": 0}
        assert "at its limit of 1" in explained.json()["error"]
        await hang_up(held)
        responses = await asyncio.gather(*waiting)
    assert [response.status_code for response in responses] == [200, 200, 200]
    # one at a time, the most urgent first, then the batch in arrival order
    assert prompts(prefill) == ["held", "interactive", "batch-1", "batch-2"]
    assert metric(cluster, "pdr_worker_queue_depth") == 0
    waits = metric(cluster, "pdr_worker_queue_wait_seconds_count", 'priority="low"')
    assert waits == 2
    cluster.wait_idle()


async def test_tenants_take_turns_at_the_cap(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    keys = {"a": "sk-team-a-0123456789abcdef", "b": "sk-team-b-0123456789abcdef"}
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(
        "tenants:\n" + "".join(f"  team-{t}:\n    keys: [{k}]\n" for t, k in keys.items())
    )
    cluster = make_cluster("sglang", admission=QUEUED, auth={"api_keys": keys_file})
    prefill = cluster.prefills[0]
    auth = {tenant: {"authorization": f"Bearer {key}"} for tenant, key in keys.items()}
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        prefill.config.hang = True
        held = [ask(client, "held", auth["a"])]
        await await_until(lambda: held_at(prefill, 1), WAIT_S, "a request held at the prefill")
        prefill.config.hang = False
        waiting = []
        for name in ("a-1", "a-2", "a-3", "b-1"):  # tenant a floods first
            waiting.append(ask(client, name, auth[name[0]]))
            await queued(cluster, len(waiting))
        await hang_up(held)
        responses = await asyncio.gather(*waiting)
    assert [response.status_code for response in responses] == [200] * 4
    assert prompts(prefill) == ["held", "a-1", "b-1", "a-2", "a-3"]  # b's turn before a's backlog


async def test_a_wait_past_the_timeout_is_429_and_past_its_deadline_503(
    make_cluster: FakeClusterFactory,
) -> None:
    async with held_prefill(make_cluster, queue_timeout_s=0.5) as at:
        cluster, prefill, client, held = at.cluster, at.prefill, at.client, at.held
        response = await ask(client, "late")
        assert_shed(response)
        assert "stayed at its in-flight cap" in response.json()["error"]["message"]
        response = await ask(client, "urgent", {"x-deadline-ms": "100"})
        assert_shed(response, 503)
        assert "deadline passed" in response.json()["error"]["message"]
        assert prompts(prefill) == ["held"]
        await hang_up(held)
    assert rejected(cluster, "worker_cap") == 1
    assert rejected(cluster, "deadline") == 1
    cluster.wait_idle()


async def test_a_client_that_leaves_the_worker_queue_passes_its_place_on(
    make_cluster: FakeClusterFactory,
) -> None:
    async with held_prefill(make_cluster) as at:
        cluster, prefill, client, held = at.cluster, at.prefill, at.client, at.held
        leaver = ask(client, "leaver")
        await queued(cluster, 1)
        stayer = ask(client, "stayer")
        await queued(cluster, 2)
        await hang_up([leaver])
        await queued(cluster, 1)
        await hang_up(held)
        assert (await stayer).status_code == 200
    assert prompts(prefill) == ["held", "stayer"]
    cluster.wait_idle()


# --------------------------------------------------------------------------- the queue alone


def capped_pool(cap: int) -> tuple[WorkerPool[None], Worker, WorkerQueue]:
    settings = AdmissionSettings(max_inflight_per_prefill=cap, queue_at_worker_caps=True)
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False, caps=settings.worker_caps())
    queue = queue_at_caps(pool, settings)
    assert queue is not None
    prefill = Worker(Role.PREFILL, "http://127.0.0.1:9000", healthy=True)
    pool.add(prefill, None)
    pool.add(Worker(Role.DECODE, "http://127.0.0.1:9001", healthy=True), None)
    return pool, prefill, queue


def start_leg(worker: Worker) -> Any:
    """A leg at ``worker`` as the pipeline runs one (``Worker.load``), started now."""
    leg = worker.load()
    leg.__enter__()
    return leg


async def test_a_free_place_is_handed_to_one_waiter_until_its_leg_started() -> None:
    _, prefill, queue = capped_pool(1)
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    running = start_leg(prefill)
    first = asyncio.create_task(queue.wait(None, Urgency(), never))
    second = asyncio.create_task(queue.wait(None, Urgency(), never))
    await await_until(lambda: queue.queued == 2, WAIT_S, "two waiters")
    assert queue.waiting(None)
    running.__exit__(None, None, None)  # the leg ends: its place goes to the first waiter
    await first
    assert not second.done() and queue.queued == 1
    queue.notify()  # a place handed out and not yet taken is not free
    queue.routed(None)  # the first made its choice ...
    queue.chosen(prefill, None)
    queue.notify()  # ... and its leg has not started yet (a prefill leg starts in a task)
    await asyncio.sleep(0)
    assert not second.done()
    leg = start_leg(prefill)  # now it has
    queue.notify()
    await asyncio.sleep(0)
    assert not second.done()
    leg.__exit__(None, None, None)
    await second
    queue.routed(None)
    assert queue.room(None) == 1 and not queue.waiting(None)
    never.cancel()


async def test_the_worker_queue_is_bounded() -> None:
    _, prefill, queue = capped_pool(1)
    start_leg(prefill)
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    settings = AdmissionSettings(
        max_inflight_per_prefill=1, queue_at_worker_caps=True, max_queued_requests=1
    )
    small = WorkerQueue(queue._pool, settings)  # noqa: SLF001 - the same pool, one place
    waiter = asyncio.create_task(small.wait(None, Urgency(), never, None))
    await await_until(lambda: small.queued == 1, WAIT_S, "one waiter")
    with pytest.raises(WorkersBusy, match="1 requests wait"):
        await small.wait(None, Urgency(), never, None)
    waiter.cancel()
    never.cancel()


def reserved_pool(reserve: int) -> tuple[list[Worker], WorkerQueue]:
    """Two prefills capped at one leg each (two places), ``reserve`` of them held back."""
    settings = AdmissionSettings(
        max_inflight_per_prefill=1, queue_at_worker_caps=True, worker_queue_reserve=reserve
    )
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False, caps=settings.worker_caps())
    queue = queue_at_caps(pool, settings)
    assert queue is not None
    prefills = [Worker(Role.PREFILL, f"http://127.0.0.1:{9000 + i}", healthy=True) for i in (0, 1)]
    for prefill in prefills:
        pool.add(prefill, None)
    pool.add(Worker(Role.DECODE, "http://127.0.0.1:9100", healthy=True), None)
    return prefills, queue


FLOOD, QUIET = Urgency(tenant="flood"), Urgency(tenant="quiet")


@pytest.mark.parametrize("reserve", [0, 1])
async def test_the_last_place_is_held_back_from_a_tenant_over_its_share(reserve: int) -> None:
    """``--worker-queue-reserve 1``: the flooding tenant (four requests in flight to the quiet
    one's one) may not take the last free place; the quiet tenant's next request takes it at
    once, without waiting for a prefill to finish. Without a reserve the flood takes it."""
    prefills, queue = reserved_pool(reserve)
    for _ in range(4):
        queue.hold(FLOOD)
    queue.hold(QUIET)
    assert queue.over_share() == (frozenset({"flood"}) if reserve else frozenset())
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    assert not queue.must_wait(None, lambda: FLOOD)  # two places free: one for the flood
    start_leg(prefills[0])
    assert queue.must_wait(None, lambda: FLOOD) is bool(reserve)
    assert not queue.must_wait(None, lambda: QUIET)
    flood = asyncio.create_task(queue.wait(None, FLOOD, never))
    await asyncio.sleep(0.01)
    assert flood.done() is not bool(reserve)  # held back, or handed the last place
    if reserve:
        quiet = asyncio.create_task(queue.wait(None, QUIET, never))
        await asyncio.wait_for(quiet, 1.0)  # queued behind the flood, and served first
        assert not flood.done()
        queue.routed(None)
        start_leg(prefills[1])
        queue.release(QUIET)  # the quiet tenant has nothing in flight: nothing held back
        assert queue.over_share() == frozenset()
        queue.notify()
        assert not flood.done()  # no place free anyway
    flood.cancel()
    never.cancel()
    await asyncio.gather(flood, return_exceptions=True)


def test_a_tenants_share_follows_its_weight() -> None:
    _, queue = reserved_pool(1)
    heavy = Urgency(tenant="heavy", weight=3.0)
    for _ in range(3):
        queue.hold(heavy)
    queue.hold(QUIET)
    assert queue.over_share() == frozenset()  # 3 of 4 with 3 of 4 of the weight: its share
    queue.hold(heavy)
    assert queue.over_share() == frozenset({"heavy"})
    assert queue.held_back(heavy) == 1 and queue.held_back(QUIET) == 0


async def test_a_place_held_back_serves_the_quiet_tenant_at_once(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    """Through the router (``--worker-queue-reserve 1``, two prefills capped at one leg): with
    tenant a's requests over its share (four in flight to b's two), the place a-1 frees is not
    handed to a-2 but kept for tenant b, whose next request is served while a's wait; once b
    has nothing in flight, a's are served. Without the reserve a-2 takes it at once and b-2
    waits behind it."""
    keys = {"a": "sk-team-a-0123456789abcdef", "b": "sk-team-b-0123456789abcdef"}
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(
        "tenants:\n" + "".join(f"  team-{t}:\n    keys: [{k}]\n" for t, k in keys.items())
    )
    admission = {**QUEUED, "worker_queue_reserve": 1}
    cluster = make_cluster("sglang", prefill=2, admission=admission, auth={"api_keys": keys_file})
    auth = {tenant: {"authorization": f"Bearer {key}"} for tenant, key in keys.items()}

    def sent() -> list[str]:
        return [prompt for prefill in cluster.prefills for prompt in prompts(prefill)]

    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        for prefill in cluster.prefills:
            prefill.config.hang = True
        a1 = [ask(client, "a-1", auth["a"])]
        await await_until(lambda: sent() == ["a-1"], WAIT_S, "a-1 held at a prefill")
        b1 = [ask(client, "b-1", auth["b"])]
        await await_until(lambda: sorted(sent()) == ["a-1", "b-1"], WAIT_S, "b-1 held too")
        for prefill in cluster.prefills:
            prefill.config.hang = False
        waiting = [ask(client, f"a-{i}", auth["a"]) for i in range(2, 6)]
        await queued(cluster, 4)
        await hang_up(a1)  # a place frees: held back from tenant a (4 in flight to b's 1)
        b2 = await client.post(
            "/v1/completions", json={**COMPLETION, "prompt": "b-2"}, headers=auth["b"]
        )
        assert b2.status_code == 200
        assert "a-2" not in sent() and metric(cluster, "pdr_worker_queue_depth") == 4
        await hang_up(b1)  # b has nothing in flight: nothing is held back from a
        responses = await asyncio.gather(*waiting)
    assert [response.status_code for response in responses] == [200] * 4
    cluster.wait_idle()
