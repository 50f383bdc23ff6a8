"""A disconnect storm against a real ``pd-cluster`` leaves every decode page free afterwards.

Clients leave 2,000 requests at every stage (waiting for pages, in the prefill, mid-transfer,
mid-decode). A prefill request cancelled while its sender reported the room's end used to lose
that report: the decode waited for it in vain and withheld the room's pages for good (5 of 1,024
after ~400 aborts). Now a cancelled prefill request lets its sender call finish first
(``worker.settling``), and every page comes back.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from testkit.cluster_process import ClusterProcess
from testkit.polling import wait_until

ROUNDS = (0.3, 1.0, 2.0, 1.5, 0.5)  # the longest a client waits, per round of requests
PER_ROUND = 400
CONCURRENCY = 40


async def _storm(url: str) -> dict[str, int]:
    rng = random.Random(5)
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=30.0) as client:

        async def one(index: int, longest_s: float) -> None:
            body = {
                "model": "sim-model",
                "prompt": "z" * rng.randint(100, 3000),
                "max_tokens": 64,
                "stream": index % 2 == 0,
            }
            async with gate:
                try:
                    async with asyncio.timeout(rng.uniform(0.001, longest_s)):
                        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                            async for _ in r.aiter_bytes():
                                pass
                            outcome = str(r.status_code)
                except TimeoutError:
                    outcome = "left"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        for longest_s in ROUNDS:
            await asyncio.gather(*(one(i, longest_s) for i in range(PER_ROUND)))
    return outcomes


def _decode_health(url: str) -> dict[str, int]:
    decode = httpx.get(f"{url}/ready", timeout=5).json()["decode"][0]["url"]
    health: dict[str, int] = httpx.get(f"{decode}/health", timeout=5).json()
    return health


@pytest.mark.slow  # ~45 s: scripts/test-slow (CI runs it)
@pytest.mark.timeout(180)
async def test_a_disconnect_storm_leaves_no_decode_page_withheld(tmp_path: Path) -> None:
    cluster = ClusterProcess(tmp_path / "cluster.log", "--", "--decode-s-per-token", "0.01")
    try:
        cluster.wait_ready()
        outcomes = await _storm(cluster.url)
        assert outcomes.get("left", 0) >= len(ROUNDS) * PER_ROUND * 0.9, outcomes
        health: dict[str, int] = {}

        def all_free() -> bool:
            health.update(_decode_health(cluster.url))
            return health["free_pages"] == 1024 and health["open_rooms"] == 0

        # a lost room status would hold its pages for the decode's 40 s drain wait, then
        # withhold them for good
        try:
            wait_until(all_free, 20.0, "every decode page free", interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the decode's /health: {health}") from None
        assert health["quarantined_pages"] == 0
    finally:
        cluster.stop()
