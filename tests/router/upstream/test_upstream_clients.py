"""Both upstream client implementations keep the same contract (the seam's conformance suite)."""

from __future__ import annotations

import time

import httpx
import pytest

from testkit.fake_cluster import FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until
from tests.router.pipeline.test_protocols import COMPLETION, completion_text, sse_events

CLIENTS = ["lean", "aiohttp", "httpx"]


@pytest.mark.parametrize("client", CLIENTS)
def test_stream_and_whole_answers(make_cluster: FakeClusterFactory, client: str) -> None:
    cluster = make_cluster("vllm-mooncake", upstream={"client": client})
    with cluster.client() as http:
        streamed = http.post("/v1/completions", json={**COMPLETION, "stream": True})
        whole = http.post("/v1/completions", json=COMPLETION)
    assert streamed.status_code == 200 and whole.status_code == 200
    assert len(completion_text(sse_events(streamed.text)).split()) == 5
    assert whole.json()["usage"]["completion_tokens"] == 5
    assert int(whole.headers["content-length"]) == len(whole.content)
    cluster.wait_idle()


@pytest.mark.parametrize("client", CLIENTS)
def test_connect_error_is_retried(make_cluster: FakeClusterFactory, client: str) -> None:
    cluster = make_cluster(
        "sglang", decode=2, upstream={"client": client}, health={"interval_s": 60.0}
    )
    cluster.stop("decode", 0)
    with cluster.client() as http:
        for _ in range(3):
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize("client", CLIENTS)
def test_idle_read_timeout(make_cluster: FakeClusterFactory, client: str) -> None:
    cluster = make_cluster(
        "sglang",
        upstream={"client": client, "read_timeout_s": 0.3},
        config=lambda: FakeConfig(check_kv=False),
    )
    cluster.decodes[0].config.token_delay = 2.0
    started = time.monotonic()
    with cluster.client() as http:
        response = http.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert time.monotonic() - started < 1.5
    assert response.status_code == 200
    last = [line for line in response.text.split("\n") if line.startswith("data: ")][-1]
    assert '"error"' in last and "timed out" in last
    cluster.decodes[0].config.token_delay = 0.0
    cluster.decodes[0].config.headers_delay = 2.0
    with cluster.client() as http:
        response = http.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 504
    cluster.wait_idle()


@pytest.mark.parametrize("client", CLIENTS)
def test_disconnect_closes_both_connections(make_cluster: FakeClusterFactory, client: str) -> None:
    cluster = make_cluster(
        "sglang",
        upstream={"client": client},
        config=lambda: FakeConfig(check_kv=False, token_delay=0.05, tokens=200),
    )
    cluster.prefills[0].config.hang = True
    with (
        httpx.Client(base_url=cluster.router_url, timeout=10) as http,
        http.stream(
            "POST", "/v1/completions", json={**COMPLETION, "max_tokens": 200, "stream": True}
        ) as response,
    ):
        next(response.iter_lines())
    wait_until(lambda: cluster.decodes[0].records[0].disconnected, 3, "decode disconnect")
    wait_until(lambda: cluster.prefills[0].records[0].disconnected, 3, "prefill disconnect")
    cluster.wait_idle()
