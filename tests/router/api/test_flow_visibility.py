"""Operators see flow control (issue 25, requirement 5): the status page's tenants and queues,
``/admin/explain``'s tenant, priority and queue position, and a tenant's ``min_priority`` cap.

The queue position ``/admin/explain`` gives is checked against the order the gate then really
admits in; the rest runs the router with fake engines on 127.0.0.1 (and the page in headless
Chromium).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.pipeline.admission_queue import Urgency
from testkit.chromium import Chromium, chromium_available
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.polling import await_until
from tests.router.pipeline.test_admission import COMPLETION, hang_up, settle
from tests.router.pipeline.test_admission_priority import Clock, full_gate, queue, release_order

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"
WAIT_S = 10.0

# (name, urgency) queued in this order behind a held unit
SCENARIOS: dict[str, list[tuple[str, Urgency]]] = {
    "one tenant, mixed priorities": [
        ("a0", Urgency(0, tenant="a")),
        ("a1", Urgency(2, tenant="a")),
        ("a2", Urgency(-1, tenant="a")),
    ],
    "a flood and a newcomer": [(f"a{i}", Urgency(0, tenant="a")) for i in range(6)],
    "two tenants, one heavier": [
        *((f"a{i}", Urgency(0, tenant="a")) for i in range(4)),
        *((f"b{i}", Urgency(0, tenant="b", weight=2.0)) for i in range(4)),
    ],
    "deadlines within a tenant": [
        ("c0", Urgency(0, 30.0, tenant="c")),
        ("c1", Urgency(0, 5.0, tenant="c")),
        ("d0", Urgency(1, tenant="d")),
    ],
}
PROBES = [Urgency(0, tenant="new"), Urgency(0, 10.0, tenant="c"), Urgency(-1, tenant="a")]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("probe", range(len(PROBES)))
async def test_the_queue_position_explained_is_where_the_request_is_then_admitted(
    scenario: str, probe: int
) -> None:
    clock = Clock()
    gate, never = await full_gate(clock)
    waiters = {name: await queue(gate, never, urgency) for name, urgency in SCENARIOS[scenario]}
    place = gate.place(PROBES[probe])
    assert place["admitted_at_once"] is False and place["queued"] == len(waiters)
    waiters["probe"] = await queue(gate, never, PROBES[probe])
    order = await release_order(gate, waiters)
    assert order.index("probe") == place["queue_position"], order


@pytest.mark.parametrize("probe", [Urgency(0), Urgency(1), Urgency(-1), Urgency(2, tenant="t")])
async def test_the_queue_position_counts_the_aged_classes(probe: Urgency) -> None:
    """Waiters of priorities 3 and 1, the first aged 2.5 periods (10 s each) by the time the
    probe arrives: the position is where the gate then admits it."""
    clock = Clock()
    gate, never = await full_gate(clock)
    waiters = {
        "p3": await queue(gate, never, Urgency(3)),
        "p3b": await queue(gate, never, Urgency(3)),
    }
    clock.now += 25.0
    waiters["p1"] = await queue(gate, never, Urgency(1, tenant="t"))
    place = gate.place(probe)
    waiters["probe"] = await queue(gate, never, probe)
    order = await release_order(gate, waiters)
    assert order.index("probe") == place["queue_position"], order


async def test_a_free_gate_admits_at_once() -> None:
    clock = Clock()
    gate, never = await full_gate(clock, max_concurrent_requests=2)
    assert gate.place(Urgency(5)) == {
        "admitted_at_once": True,
        "queue_position": 0,
        "queued": 0,
        "queue_full": False,
    }


# --------------------------------------------------------------------------- through the router


def keys_file(tmp_path: Path) -> Path:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"tenants:\n  team-a:\n    keys: [{KEY_A}]\n    priority: 5\n"
        "    requests_per_minute: 1000\n"
        f"  team-b:\n    keys: [{KEY_B}]\n    weight: 2\n    min_priority: 0\n"
    )
    return keys


def send(
    client: httpx.AsyncClient, key: str, headers: dict[str, str] | None = None, **body: Any
) -> asyncio.Task[httpx.Response]:
    sent = {"authorization": f"Bearer {key}", **(headers or {})}
    return asyncio.create_task(
        client.post("/v1/completions", json={**COMPLETION, **body}, headers=sent)
    )


def one_slot_cluster(make_cluster: FakeClusterFactory, tmp_path: Path) -> FakeCluster:
    """A router of one admission slot with the two tenants' keys, its decode holding every
    request (the slot stays taken)."""
    admission = {"max_concurrent_requests": 1}
    cluster = make_cluster("sglang", admission=admission, auth={"api_keys": keys_file(tmp_path)})
    cluster.decodes[0].config.hang = True
    return cluster


async def flooded(cluster: FakeCluster, client: httpx.AsyncClient) -> list[asyncio.Task[Any]]:
    """team-a holds the one unit and queues two more of its priority 5; team-b queues one of
    priority 0 (its X-Priority -3 capped by its min_priority)."""
    held = [send(client, KEY_A)]
    await settle(cluster, inflight=1, queued=0)
    held += [send(client, KEY_A), send(client, KEY_A)]
    await settle(cluster, inflight=1, queued=2)
    held.append(send(client, KEY_B, {"x-priority": "-3"}))
    await settle(cluster, inflight=1, queued=3)
    return held


async def test_status_data_and_explain_show_tenants_priorities_and_queue_places(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    cluster = one_slot_cluster(make_cluster, tmp_path)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        held = await flooded(cluster, client)
        data = (await client.get("/status/data")).json()
        assert data["admission"]["queued_by_priority"] == {"high": 0, "normal": 1, "low": 2}
        tenants = {row["name"]: row for row in data["tenants"]}
        expected_a = {"name": "team-a", "priority": 5, "min_priority": None, "weight": 1.0}
        expected_a |= {"requests_per_minute": 1000, "tokens_per_minute": None}
        expected_a |= {"max_concurrent": None, "in_flight": 3, "queued": 2}
        assert tenants["team-a"] == expected_a
        assert (tenants["team-b"]["in_flight"], tenants["team-b"]["queued"]) == (1, 1)
        assert tenants["team-b"]["min_priority"] == 0 and tenants["team-b"]["weight"] == 2.0

        async def explain(query: str, **headers: str) -> dict[str, Any]:
            answer = await client.post(f"/admin/explain{query}", json=COMPLETION, headers=headers)
            assert answer.status_code == 200, answer.text
            admission: dict[str, Any] = answer.json()["admission"]
            return admission

        a = await explain("?tenant=team-a")
        assert (a["tenant"], a["priority"], a["tenant_in_flight"]) == ("team-a", 5, 3)
        assert (a["admitted_at_once"], a["queue_position"], a["queued"]) == (False, 3, 3)
        b = await explain("?tenant=team-b", **{"x-priority": "-7", "x-deadline-ms": "2500"})
        assert (b["priority"], b["deadline_ms"], b["weight"]) == (0, 2500, 2.0)  # capped
        assert b["queue_position"] == 0  # its deadline before its tenant's queued request's
        b = await explain("?tenant=team-b")
        assert (b["priority"], b["deadline_ms"], b["queue_position"]) == (0, None, 1)
        urgent = await explain("", **{"x-priority": "-2"})  # no tenant: anyone's -2
        assert (urgent["tenant"], urgent["priority"], urgent["queue_position"]) == (None, -2, 0)
        unknown = await client.post("/admin/explain?tenant=nobody", json=COMPLETION)
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tenant"
        await hang_up(held)
    await settle(cluster, inflight=0, queued=0)


async def test_a_tenants_min_priority_caps_the_priority_the_engines_get(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    """team-b may ask for no priority more urgent than 0: its body's ``priority: -4`` reaches
    the engines as 0; team-a, without a cap, keeps its -4."""
    cluster = make_cluster("vllm-nixl", auth={"api_keys": keys_file(tmp_path)})
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        for key in (KEY_B, KEY_A):
            answer = await send(client, key, priority=-4)
            assert answer.status_code == 200, answer.text
    decode = cluster.decodes[0]
    assert [record.body["priority"] for record in decode.records] == [0, -4]
    assert [record.body["priority"] for record in cluster.prefills[0].records] == [0, -4]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not chromium_available(), reason="needs Chromium (scripts/setup-test.sh)")
async def test_the_status_page_shows_tenants_and_queues_in_headless_chromium(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    cluster = one_slot_cluster(make_cluster, tmp_path)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=30) as client:
        held = await flooded(cluster, client)
        async with Chromium(tmp_path) as browser:
            await browser.navigate(f"{cluster.router_url}/status")
            cells = """[...document.querySelectorAll('tr[data-tenant="team-a"] td')]
                .map((td) => td.textContent)"""
            await browser.wait_for(f"({cells}).length === 8", 30, "team-a's row")
            row = await browser.evaluate(cells)
            assert row[:5] == ["team-a", "3", "2", "5", "1"], row
            assert (
                await browser.evaluate("document.getElementById('admission-bands').textContent")
                == "high 0 · normal 1 · low 2"
            )
            assert not await browser.evaluate("document.getElementById('tenants-section').hidden")
        await hang_up(held)
    await await_until(lambda: cluster.decodes[0].inflight == 0, WAIT_S, "the held ones gone")
