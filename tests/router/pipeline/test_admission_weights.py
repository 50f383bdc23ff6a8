"""Admission counts sequences and request-body memory (issue 21, finding 5).

A request takes a unit of ``--max-concurrent-requests`` per sequence (``n`` x prompts), at most
all of them, so 8 requests with ``n: 128`` cannot start 1,024 sequences past a limit of 64; and
the bodies held in the router count against ``--max-body-memory`` (429 beyond it, at once).
Real router and fake engines on 127.0.0.1 (a decode that hangs holds requests open), and the
gate alone for its order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import pytest

from router.errors import Overloaded
from router.pipeline.admission import BODY_MEMORY_FACTOR, AdmissionGate
from router.settings import AdmissionSettings
from testkit.fake_cluster import FakeClusterFactory
from testkit.polling import await_until
from tests.router.pipeline.test_admission import (
    COMPLETION,
    WAIT_S,
    assert_shed,
    hang_up,
    post,
    rejected,
    settle,
)

KIB = 1024


# --------------------------------------------------------------------------- sequences


async def test_a_request_takes_a_unit_per_sequence(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", admission={"max_concurrent_requests": 4})
    decode = cluster.decodes[0]
    decode.config.hang = True
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        wide = post(client, n=3)  # 3 of the 4 units
        await settle(cluster, inflight=1, queued=0)
        narrow = post(client)  # fits in the fourth
        await settle(cluster, inflight=2, queued=0)
        batch = post(client, prompt=["a", "b"])  # 2 sequences: waits for units
        await settle(cluster, inflight=2, queued=1)
        await hang_up([wide])  # 3 units come back: the batch is admitted
        await settle(cluster, inflight=2, queued=0)
        await await_until(lambda: decode.inflight == 2, WAIT_S, "the batch at the decode")
        await hang_up([narrow, batch])
    await settle(cluster, inflight=0, queued=0)


def _reached(admitted: list[int], count: int) -> bool:
    return len(admitted) == count


async def test_one_request_larger_than_the_limit_runs_alone() -> None:
    """8 requests of n=128 against a limit of 64: one at a time, in order, never 1,024
    sequences at once."""
    gate = AdmissionGate(AdmissionSettings(max_concurrent_requests=64, max_queued_requests=8))
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    admitted: list[int] = []

    async def request(index: int) -> None:
        await gate.acquire(never, 128)
        admitted.append(index)

    tasks = [asyncio.create_task(request(index)) for index in range(8)]
    await await_until(lambda: len(admitted) == 1 and gate.queued == 7, WAIT_S, "one admitted")
    assert (gate.units, gate.inflight) == (64, 1)
    for served in range(1, 8):
        small = asyncio.create_task(gate.acquire(never))  # queued behind the big ones
        gate.release(128)
        await await_until(partial(_reached, admitted, served + 1), WAIT_S, "the next big one")
        assert (gate.units, gate.inflight) == (64, 1) and not small.done()
        small.cancel()
        await asyncio.gather(small, return_exceptions=True)
    assert admitted == list(range(8))
    await asyncio.gather(*tasks)
    gate.release(128)
    assert (gate.units, gate.inflight, gate.queued) == (0, 0, 0)
    never.cancel()


async def test_a_waiter_that_leaves_lets_smaller_ones_behind_it_in() -> None:
    gate = AdmissionGate(AdmissionSettings(max_concurrent_requests=4, max_queued_requests=8))
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    await gate.acquire(never, 3)
    big = asyncio.create_task(gate.acquire(never, 4))
    small = asyncio.create_task(gate.acquire(never, 1))
    await await_until(lambda: gate.queued == 2, WAIT_S, "two waiters")
    assert not small.done()  # one unit is free, but the big one is ahead
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)
    await small
    assert (gate.units, gate.inflight, gate.queued) == (4, 2, 0)
    never.cancel()


# --------------------------------------------------------------------------- body memory


def _body(size: int) -> bytes:
    """A completion body of about ``size`` bytes."""
    return json.dumps({**COMPLETION, "stop": ["x" * size]}).encode()


async def test_bodies_over_the_memory_budget_get_429_at_once(
    make_cluster: FakeClusterFactory,
) -> None:
    body = _body(100 * KIB)
    budget = len(body) * BODY_MEMORY_FACTOR * 3 // 2  # room for one such body, not two
    cluster = make_cluster("vllm-nixl", admission={"max_body_memory_bytes": budget})
    decode = cluster.decodes[0]
    decode.config.hang = True
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        held = asyncio.create_task(client.post("/v1/completions", content=body, headers=headers))
        await settle(cluster, inflight=1, queued=0)
        response = await client.post("/v1/completions", content=body, headers=headers)
        assert_shed(response)
        assert "--max-body-memory" in response.json()["error"]["message"]

        async def pieces() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            for start in range(0, len(body), 16 * KIB):
                yield body[start : start + 16 * KIB]

        response = await client.post("/v1/completions", content=pieces(), headers=headers)
        assert_shed(response)
        small = post(client)  # a small body still fits beside the held one
        await settle(cluster, inflight=2, queued=0)
        await hang_up([held, small])
        await settle(cluster, inflight=0, queued=0)
        decode.config.hang = False
        again = await client.post("/v1/completions", content=body, headers=headers)
    assert again.status_code == 200, again.text  # the budget came back
    assert rejected(cluster, "body_memory") == 2


@pytest.mark.parametrize("flag_value", ["0", str(1 << 30)])
def test_the_flag_sets_the_body_memory_budget(flag_value: str) -> None:
    from router.server.cli import parse_args

    settings = parse_args(["--max-body-memory", flag_value])
    assert settings.admission.max_body_memory_bytes == int(flag_value)


def test_the_budget_refuses_only_when_another_request_holds_some() -> None:
    gate = AdmissionGate(AdmissionSettings(max_body_memory_bytes=1000))
    memory = gate.body_memory
    memory.take(5000)  # alone: a body larger than the whole budget is taken
    with pytest.raises(Overloaded):
        memory.take(1)
    memory.take(10, own=5000)  # its own share grows
    memory.give_back(5010)
    memory.take(600)
    with pytest.raises(Overloaded) as info:
        memory.take(600)
    assert info.value.reason == "body_memory" and info.value.status == 429
