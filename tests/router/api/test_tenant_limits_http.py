"""Per-tenant limits from the keys file, through a real router and fake engines: requests per
minute, tokens per minute (the estimate, corrected by the answer's usage) and requests in
flight; over a limit a 429 with ``Retry-After`` and the ``x-ratelimit-*`` headers that reaches no
engine; within, the answer carries the headers. One tenant's limit never holds another back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"
COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}


def _cluster(
    make_cluster: FakeClusterFactory, tmp_path: Path, limits: str, token_delay: float = 0.0
) -> FakeCluster:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"tenants:\n  team-a:\n    keys: [{KEY_A}]\n{limits}  team-b:\n    keys: [{KEY_B}]\n"
    )
    return make_cluster(
        "vllm-mooncake",
        config=lambda: FakeConfig(kv_timeout=20.0, token_delay=token_delay),
        auth={"api_keys": keys},
    )


def _post(cluster: FakeCluster, key: str, body: object = COMPLETION) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(
        cluster.router_url + "/v1/completions", json=body, headers=headers, timeout=10
    )


def _rejected(cluster: FakeCluster, reason: str) -> float:
    for line in httpx.get(cluster.router_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'pdr_admission_rejected_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_requests_per_minute_count_down_then_429_with_retry_after(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    cluster = _cluster(make_cluster, tmp_path, "    requests_per_minute: 2\n")
    first, second = _post(cluster, KEY_A), _post(cluster, KEY_A)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    remaining = [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)]
    assert remaining == ["1", "0"]
    refused = _post(cluster, KEY_A)
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.json()["error"]["code"] == 429
    assert len(cluster.decodes[0].records) == 2  # the refused one reached no engine
    assert _post(cluster, KEY_B).status_code == 200  # another tenant is not held back
    assert _rejected(cluster, "tenant_requests") == 1


def test_tokens_per_minute_charge_the_estimate_and_then_the_usage(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    cluster = _cluster(make_cluster, tmp_path, "    tokens_per_minute: 40\n")
    too_big = _post(cluster, KEY_A, {**COMPLETION, "max_tokens": 100})
    assert too_big.status_code == 429 and too_big.json()["error"]["type"] == "tokens"
    served = _post(cluster, KEY_A, {**COMPLETION, "max_tokens": 30})  # estimated ~31
    assert served.status_code == 200
    used = served.json()["usage"]["total_tokens"]
    assert used < 30
    # the charge was corrected to the usage: what is left shows in the next answer
    after = _post(cluster, KEY_A)
    assert after.status_code == 200
    assert int(after.headers["x-ratelimit-remaining-tokens"]) <= 40 - used - 1


def test_requests_in_flight_are_capped_per_tenant(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    cluster = _cluster(make_cluster, tmp_path, "    max_concurrent: 1\n", token_delay=0.3)
    stream = {**COMPLETION, "stream": True}

    async def two_at_once() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster.router_url, timeout=10) as client:
            headers = {"authorization": f"Bearer {KEY_A}"}
            first = asyncio.create_task(
                client.post("/v1/completions", json=stream, headers=headers)
            )
            await asyncio.to_thread(
                wait_until, lambda: bool(cluster.decodes[0].records), 5, "the first in flight"
            )
            second = await client.post("/v1/completions", json=COMPLETION, headers=headers)
            return [(await first).status_code, second.status_code]

    assert asyncio.run(two_at_once()) == [200, 429]
    assert _post(cluster, KEY_A).status_code == 200  # the slot came back with the answer
    assert _rejected(cluster, "tenant_concurrency") == 1


def test_pass_through_requests_count_in_their_tenants_limits(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    """``/tokenize`` and ``/detokenize`` charge a request and their tokens (the token ids to
    detokenize): a tenant at its rate gets the same 429 there, reaching no engine."""
    limits = "    requests_per_minute: 3\n    tokens_per_minute: 50\n"
    cluster = _cluster(make_cluster, tmp_path, limits)
    headers = {"authorization": f"Bearer {KEY_A}"}

    def post(path: str, body: object) -> httpx.Response:
        return httpx.post(cluster.router_url + path, json=body, headers=headers, timeout=10)

    first = post("/tokenize", {"model": "fake-model", "prompt": "hello"})
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "2"
    too_many_tokens = post("/detokenize", {"model": "fake-model", "tokens": [104] * 60})
    assert too_many_tokens.status_code == 429
    assert too_many_tokens.json()["error"]["type"] == "tokens"
    assert post("/detokenize", {"model": "fake-model", "tokens": [104]}).status_code == 200
    assert _post(cluster, KEY_A).status_code == 200  # a completion: the third request
    refused = post("/tokenize", {"model": "fake-model", "prompt": "hello"})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert cluster.prefills[0].passthrough_calls == ["/tokenize", "/detokenize"]
