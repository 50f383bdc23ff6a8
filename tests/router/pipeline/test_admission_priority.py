"""The admission queue releases the most urgent first, ages, sheds and is fair (issue 25,
requirements 3 and 4).

The gate alone, driven with futures and an injected clock: a budget of one unit is held, the
waiters queue behind it, and each ``release`` admits exactly one of them, whose name is read
off the task that finished. Then the real router with fake engines on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.errors import Overloaded, Shed
from router.pipeline.admission import AdmissionGate
from router.pipeline.admission_queue import Urgency
from router.settings import AdmissionSettings
from testkit.fake_cluster import FakeClusterFactory
from testkit.polling import await_until
from tests.router.pipeline.test_admission import (
    COMPLETION,
    assert_shed,
    hang_up,
    post,
    rejected,
    settle,
)

WAIT_S = 10.0
KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def full_gate(clock: Clock, **settings: Any) -> tuple[AdmissionGate, asyncio.Future[Any]]:
    """A gate of one unit, held; and a client that never leaves."""
    values: dict[str, Any] = {"max_concurrent_requests": 1, "max_queued_requests": 64}
    gate = AdmissionGate(AdmissionSettings(**{**values, **settings}), clock=clock)
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    await gate.acquire(never)
    return gate, never


async def queue(
    gate: AdmissionGate, never: asyncio.Future[Any], urgency: Urgency
) -> asyncio.Task[None]:
    """A waiter of ``urgency``, queued before this returns."""
    queued = gate.queued
    task = asyncio.create_task(gate.acquire(never, 1, urgency))
    await await_until(lambda: gate.queued == queued + 1 or task.done(), WAIT_S, "queued")
    return task


async def release_order(gate: AdmissionGate, waiters: dict[str, asyncio.Task[None]]) -> list[str]:
    """Release the held unit once per waiter; the order they were admitted in."""
    order: list[str] = []
    pending = dict(waiters)
    while pending:
        gate.release()
        await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
        done = [name for name, task in pending.items() if task.done()]
        assert len(done) == 1, done  # one unit, one admission
        order.append(done[0])
        await pending.pop(done[0])  # admitted, not failed
    return order


async def test_the_most_urgent_priority_goes_first_then_the_earliest_deadline_then_arrival() -> (
    None
):
    clock = Clock()
    gate, never = await full_gate(clock)
    waiters = {
        "p5": await queue(gate, never, Urgency(5)),
        "p0": await queue(gate, never, Urgency(0)),
        "p3": await queue(gate, never, Urgency(3)),
        "p1-first": await queue(gate, never, Urgency(1)),
        "p1-late-deadline": await queue(gate, never, Urgency(1, deadline_s=20)),
        "p1-early-deadline": await queue(gate, never, Urgency(1, deadline_s=10)),
        "p1-last": await queue(gate, never, Urgency(1)),
    }
    assert await release_order(gate, waiters) == [
        "p0",
        "p1-early-deadline",
        "p1-late-deadline",
        "p1-first",
        "p1-last",
        "p3",
        "p5",
    ]


async def test_a_waiter_ages_one_level_per_aging_period_and_overtakes_newer_urgent_ones() -> None:
    """Released at t = 35 s (aging 10 s): a priority counts as ``priority - waited / 10``."""
    clock = Clock()
    gate, never = await full_gate(clock, aging_s=10.0)
    waiters = {"old-p3": await queue(gate, never, Urgency(3))}  # at 35 s: 3 - 3.5 = -0.5
    clock.now += 15.0
    waiters["p1-after-15s"] = await queue(gate, never, Urgency(1))  # 1 - 2 = -1: first
    clock.now += 20.0
    waiters["p1-after-35s"] = await queue(gate, never, Urgency(1))  # 1: after the old p3
    waiters["p0-after-35s"] = await queue(gate, never, Urgency(0))  # 0
    assert await release_order(gate, waiters) == [
        "p1-after-15s",
        "old-p3",
        "p0-after-35s",
        "p1-after-35s",
    ]


async def test_aging_never_lets_one_tenants_backlog_pass_another_tenants_newer_requests() -> None:
    """Tenant a's 20 waiters have waited several aging periods when tenant b's request comes,
    of the same priority: b still takes its turn at once (aging moves a whole priority class,
    never a tenant's backlog ahead of another tenant's newer requests)."""
    clock = Clock()
    gate, never = await full_gate(clock, aging_s=10.0)
    waiters = {f"a{i}": await queue(gate, never, Urgency(0, tenant="a")) for i in range(20)}
    clock.now += 35.0
    waiters["b"] = await queue(gate, never, Urgency(0, tenant="b"))
    order = await release_order(gate, waiters)
    assert order.index("b") <= 1, order


async def test_without_aging_priority_alone_orders() -> None:
    clock = Clock()
    gate, never = await full_gate(clock, aging_s=0)
    waiters = {"old-p3": await queue(gate, never, Urgency(3))}
    clock.now += 10_000
    waiters["new-p1"] = await queue(gate, never, Urgency(1))
    assert await release_order(gate, waiters) == ["new-p1", "old-p3"]


async def test_a_full_queue_sheds_its_least_urgent_for_a_more_urgent_arrival() -> None:
    clock = Clock()
    gate, never = await full_gate(clock, max_queued_requests=2)
    urgent = await queue(gate, never, Urgency(0))
    lax = await queue(gate, never, Urgency(5))
    # the queue is full: p5 makes room for a p1
    middle = asyncio.create_task(gate.acquire(never, 1, Urgency(1)))
    with pytest.raises(Shed) as shed:
        await lax
    assert (shed.value.status, shed.value.reason) == (503, "shed")
    assert shed.value.headers == ((b"retry-after", b"1"),)
    assert gate.queued == 2
    for lesser in (Urgency(3), Urgency(1)):  # not more urgent than the least urgent (p1): 429
        with pytest.raises(Overloaded) as full:
            await gate.acquire(never, 1, lesser)
        assert (full.value.status, full.value.reason) == (429, "queue_full")
    assert gate.queued == 2
    assert await release_order(gate, {"urgent": urgent, "middle": middle}) == ["urgent", "middle"]


async def test_a_request_whose_deadline_passes_while_queued_is_refused_at_once() -> None:
    clock = Clock()
    gate, never = await full_gate(clock, queue_timeout_s=30.0)
    with pytest.raises(Shed) as passed:  # no time left at all: never queued
        await gate.acquire(never, 1, Urgency(0, deadline_s=0))
    assert (passed.value.status, passed.value.reason) == (503, "deadline")
    patient = await queue(gate, never, Urgency(0))
    hurried = await queue(gate, never, Urgency(0, deadline_s=0.05))
    with pytest.raises(Shed) as late:  # well before the 30 s queue timeout
        await asyncio.wait_for(hurried, WAIT_S)
    assert late.value.reason == "deadline"
    assert gate.queued == 1 and not patient.done()
    assert await release_order(gate, {"patient": patient}) == ["patient"]


async def fair_order(weight_b: float) -> list[str]:
    """Tenant a floods 20 waiters, then tenant b queues 2: who is admitted, in order."""
    clock = Clock()
    gate, never = await full_gate(clock)
    waiters = {f"a{i}": await queue(gate, never, Urgency(0, tenant="a")) for i in range(20)}
    for i in range(2):
        waiters[f"b{i}"] = await queue(gate, never, Urgency(0, tenant="b", weight=weight_b))
    return await release_order(gate, waiters)


async def test_one_tenants_flood_does_not_hold_back_another_tenant() -> None:
    order = await fair_order(1.0)
    assert order.index("b0") <= 2 and order.index("b1") <= 4, order  # alternating, not 21st
    assert [name for name in order if name.startswith("a")] == [f"a{i}" for i in range(20)]


async def test_a_heavier_tenant_gets_a_larger_share() -> None:
    order = await fair_order(2.0)
    assert order[:3] == ["a0", "b0", "b1"], order  # two of b's units cost one of a's


async def test_the_anonymous_tenant_and_a_named_one_share_fairly() -> None:
    clock = Clock()
    gate, never = await full_gate(clock)
    waiters = {f"anon{i}": await queue(gate, never, Urgency(0)) for i in range(5)}
    waiters["t"] = await queue(gate, never, Urgency(0, tenant="t"))
    assert (await release_order(gate, waiters)).index("t") <= 2


async def test_waiters_that_leave_are_dropped_and_the_rest_keep_their_order() -> None:
    clock = Clock()
    gate, never = await full_gate(clock, max_queued_requests=300)
    leavers = [await queue(gate, never, Urgency(-1)) for _ in range(200)]
    stay = {"p2": await queue(gate, never, Urgency(2)), "p1": await queue(gate, never, Urgency(1))}
    for task in leavers:
        task.cancel()
    await asyncio.gather(*leavers, return_exceptions=True)
    assert gate.queued == 2
    assert await release_order(gate, stay) == ["p1", "p2"]
    assert (gate.units, gate.inflight, gate.queued) == (1, 1, 0)


# --------------------------------------------------------------------------- through the router


async def test_an_urgent_request_overtakes_queued_ones_and_vllm_gets_its_priority(
    make_cluster: FakeClusterFactory,
) -> None:
    """Behind a held unit, two requests of priority 5 (X-Priority) queue, then one of -1: it
    is served next, and with --forward-priority the vLLM engines get its priority in the
    body (the first request, of the default priority 0, gets none)."""
    admission = {"max_concurrent_requests": 1, "forward_priority": True}
    cluster = make_cluster("vllm-nixl", admission=admission)
    decode = cluster.decodes[0]
    decode.config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:

        def send(priority: int | None) -> asyncio.Task[httpx.Response]:
            headers = {} if priority is None else {"x-priority": str(priority)}
            return asyncio.create_task(
                client.post("/v1/completions", json=COMPLETION, headers=headers)
            )

        first = send(None)
        await settle(cluster, inflight=1, queued=0)
        lax = [send(5), send(5)]
        await settle(cluster, inflight=1, queued=2)
        urgent = send(-1)
        await settle(cluster, inflight=1, queued=3)
        await await_until(lambda: len(decode.records) == 1, WAIT_S, "the first at the decode")
        await hang_up([first])
        await await_until(lambda: len(decode.records) == 2, WAIT_S, "the next at the decode")
        assert "priority" not in decode.records[0].body
        assert decode.records[1].body["priority"] == -1
        assert cluster.prefills[0].records[1].body["priority"] == -1
        await settle(cluster, inflight=1, queued=2)
        await hang_up([urgent, *lax])
    await settle(cluster, inflight=0, queued=0)


async def test_a_malformed_priority_header_is_a_400_when_the_request_must_wait(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang", admission={"max_concurrent_requests": 1})
    cluster.decodes[0].config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        held = [post(client)]
        await settle(cluster, inflight=1, queued=0)
        response = await client.post(
            "/v1/completions", json=COMPLETION, headers={"x-priority": "urgent"}
        )
        assert response.status_code == 400, response.text
        assert "x-priority" in response.json()["error"]["message"]
        response = await client.post(
            "/v1/completions", json=COMPLETION, headers={"x-deadline-ms": "0"}
        )
        assert_shed(response, 503)
        await hang_up(held)
    assert rejected(cluster, "deadline") == 1
    await settle(cluster, inflight=0, queued=0)


async def test_a_tenants_default_priority_orders_its_requests(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    """team-a's requests default to priority 5 (the keys file), team-b's to 0: b's request,
    queued last, is served before a's."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"tenants:\n  team-a:\n    keys: [{KEY_A}]\n    priority: 5\n"
        f"  team-b:\n    keys: [{KEY_B}]\n    weight: 2\n"
    )
    admission = {"max_concurrent_requests": 1}
    cluster = make_cluster("vllm-nixl", admission=admission, auth={"api_keys": keys})
    decode = cluster.decodes[0]
    decode.config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:

        def send(key: str, prompt: str) -> asyncio.Task[httpx.Response]:
            body, headers = {**COMPLETION, "prompt": prompt}, {"authorization": f"Bearer {key}"}
            return asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))

        first = send(KEY_A, "a0")
        await settle(cluster, inflight=1, queued=0)
        queued = [send(KEY_A, "a1"), send(KEY_A, "a2")]
        await settle(cluster, inflight=1, queued=2)
        queued.append(send(KEY_B, "b"))
        await settle(cluster, inflight=1, queued=3)
        await await_until(lambda: len(decode.records) == 1, WAIT_S, "the first at the decode")
        await hang_up([first])
        await await_until(lambda: len(decode.records) == 2, WAIT_S, "the next at the decode")
        assert decode.records[1].body["prompt"] == "b"
        assert "priority" not in decode.records[1].body  # not forwarded: --forward-priority off
        await hang_up(queued)
    await settle(cluster, inflight=0, queued=0)
