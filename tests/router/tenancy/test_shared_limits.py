"""Router replicas sharing their tenants' limits through a real Redis (``testkit.redis_server``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from router.errors import RateLimited
from router.tenancy.limiter import Admitted, TenantLimiter, TenantLimits
from testkit.fake_cluster import FakeClusterFactory
from testkit.redis_server import RedisServer


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[TenantLimiter, ...]]:
    """Two limiters, as two router replicas would build them, on one Redis."""
    limits = {"acme": TenantLimits(requests_per_minute=5, tokens_per_minute=1000)}
    pair = (TenantLimiter(limits, redis_server.url), TenantLimiter(limits, redis_server.url))
    yield pair
    for limiter in pair:
        await limiter.aclose()


async def _try(limiter: TenantLimiter, tokens: int) -> Admitted | None:
    try:
        return await limiter.admit("acme", tokens)
    except RateLimited:
        return None


async def test_replicas_together_admit_at_most_the_limit(
    replicas: tuple[TenantLimiter, ...],
) -> None:
    attempts = [_try(replicas[i % 2], 1) for i in range(20)]
    admitted = [a for a in await asyncio.gather(*attempts) if a is not None]
    assert len(admitted) == 5
    for limiter in replicas:
        with pytest.raises(RateLimited) as refused:
            await limiter.admit("acme", 1)
        assert 0 < refused.value.retry_after_s <= 60


async def test_tokens_are_shared_and_corrected_across_replicas(
    replicas: tuple[TenantLimiter, ...],
) -> None:
    one, other = replicas
    first = await one.admit("acme", 900)
    with pytest.raises(RateLimited):
        await other.admit("acme", 200)
    await first.finish(100)  # 800 given back, seen by the other replica
    second = await other.admit("acme", 800)
    assert dict(second.headers)[b"x-ratelimit-remaining-tokens"] == b"100"
    await second.finish(1000)  # 200 more than estimated: counted for both
    with pytest.raises(RateLimited):
        await one.admit("acme", 1)


async def test_a_lost_storage_fails_open(
    redis_server: RedisServer, replicas: tuple[TenantLimiter, ...], caplog: pytest.LogCaptureFixture
) -> None:
    redis_server.stop()
    admitted = await replicas[0].admit("acme", 10**6)  # served, unlimited, and logged
    assert admitted.headers == ()
    assert "tenant limits not enforced" in caplog.text
    await admitted.finish(10)


def test_a_router_on_a_shared_storage_counts_its_tenants_there(
    make_cluster: FakeClusterFactory, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Through a real router with ``--rate-limit-storage redis://...``: its answers carry the
    headers and it refuses past the limit, and the counts are in the Redis (another replica
    on it is refused too)."""
    key = "sk-shared-0123456789abcdef"
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"tenants:\n  acme:\n    keys: [{key}]\n    requests_per_minute: 2\n")
    cluster = make_cluster(
        "vllm-mooncake", auth={"api_keys": keys, "rate_limit_storage": redis_server.url}
    )
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}
    headers = {"authorization": f"Bearer {key}"}
    url = cluster.router_url + "/v1/completions"
    answers = [httpx.post(url, json=body, headers=headers, timeout=10) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    remaining = [a.headers["x-ratelimit-remaining-requests"] for a in answers[:2]]
    assert remaining == ["1", "0"]

    async def another_replica() -> None:
        limiter = TenantLimiter({"acme": TenantLimits(requests_per_minute=2)}, redis_server.url)
        try:
            with pytest.raises(RateLimited):
                await limiter.admit("acme", 1)
        finally:
            await limiter.aclose()

    asyncio.run(another_replica())
