"""A PD cluster of simulated workers queues a burst larger than its pools, and gets every page of
its aborted requests back (``worker.page_queue``, ``worker.serving``).

Prefill and decode pools of 128 pages (2,048 tokens) behind the real router: a burst needing
about 2.3 times that is served in full (the requests wait for pages instead of failing with
503). A storm of clients that leave mid-transfer (the prefill's writes are slowed past the
receiver's old 2 s drain wait) and mid-decode leaves no page withheld: the decode waits for the
prefill to confirm its writes are over, then frees them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from testkit.worker_cluster import PDCluster, pd_cluster
from worker.kv import PoolShape

SMALL = PoolShape(layers=2, page_size=16, bytes_per_token=64, pages=128)
BURST = 12  # requests of 400 tokens: 25 pages each, 300 pages on each side
PROMPT_TOKENS = 400


def _prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)  # distinct prompts: no prefix cache sharing
    return [
        "".join(rng.choice("abcdefghij klmnop") for _ in range(PROMPT_TOKENS)) for _ in range(count)
    ]


@pytest.fixture(params=["sglang", "vllm-mooncake"])
def small_cluster(request: pytest.FixtureRequest) -> Iterator[PDCluster]:
    with pd_cluster(
        engine=request.param,
        transfer_timeout_s=30.0,
        prefill_options={"shape": SMALL, "compute_s_per_token": 0.0005},
        decode_options={"shape": SMALL, "decode_s_per_token": 0.05},
    ) as cluster:
        yield cluster


def _post(cluster: PDCluster, prompt: str, timeout: float, **extra: Any) -> int | str:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 32, **extra}
    try:
        return httpx.post(
            f"{cluster.router}/v1/completions", json=body, timeout=timeout
        ).status_code
    except httpx.TimeoutException:
        return "left"


def test_a_burst_larger_than_the_pools_is_served_in_full(small_cluster: PDCluster) -> None:
    prompts = _prompts(BURST, 3)
    assert 2 * SMALL.pages * SMALL.page_size < BURST * PROMPT_TOKENS
    with ThreadPoolExecutor(BURST) as pool:
        statuses = list(pool.map(lambda p: _post(small_cluster, p, 30.0), prompts))
    assert statuses == [200] * BURST
    small_cluster.wait_idle(timeout=10.0)


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_a_disconnect_storm_gives_every_page_back(small_cluster: PDCluster) -> None:
    for side in small_cluster.prefills:
        side.engine.delay_s = 2.5  # each KV write outlasts the receiver's old 2 s drain wait
    prompts = _prompts(BURST, 4)
    timeouts = [0.2 + 4.8 * i / BURST for i in range(BURST)]  # mid-transfer .. mid-decode
    with ThreadPoolExecutor(BURST) as pool:
        outcomes = list(
            pool.map(
                lambda a: _post(small_cluster, a[0], a[1], stream=True),
                zip(prompts, timeouts, strict=True),
            )
        )
    assert outcomes.count("left") >= BURST // 2, outcomes
    small_cluster.wait_idle(timeout=15.0)
