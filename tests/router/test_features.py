"""The CPU ledger's switches (``PDR_FEATURES__*``, bench.load.peers --ledger): each one off
really takes its feature off the request path, and on (the default) keeps it."""

from __future__ import annotations

import threading

import pytest

from testkit.fake_cluster import FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until
from tests.router.observability.test_router_observability import scrape, value

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("on", [True, False])
def test_receipts_metrics_and_trace_headers_switch(
    make_cluster: FakeClusterFactory, on: bool
) -> None:
    switches = {"receipts": on, "metrics": on, "trace_headers": on}
    cluster = make_cluster("vllm-mooncake", features=switches)
    with cluster.client() as client:
        response = client.post(
            "/v1/completions", json=COMPLETION, headers={"traceparent": TRACEPARENT}
        )
        assert response.status_code == 200
        metrics = scrape(client)
    assert ("x-pdr-decode" in response.headers) is on
    counted = value(
        metrics, "pdr_requests_total", endpoint="/v1/completions", status="200", stream="false"
    )
    assert counted == (1 if on else None)
    (decoded,) = cluster.decodes[0].records
    assert (decoded.headers.get("traceparent") == TRACEPARENT) is on


@pytest.mark.parametrize("on", [True, False])
def test_breakers_switch(make_cluster: FakeClusterFactory, on: bool) -> None:
    cluster = make_cluster(
        "vllm-mooncake",
        features={"breakers": on},
        health={"interval_s": 60.0, "failure_threshold": 2},
        config=lambda: FakeConfig(check_kv=False),
    )
    cluster.decodes[0].config.fail_status = 500
    with cluster.client() as client:
        statuses = [client.post("/v1/completions", json=COMPLETION).status_code for _ in range(3)]
    # on: the breakers opened after two failures and the third request found no worker
    assert statuses == ([500, 500, 503] if on else [500, 500, 500])
    assert bool(cluster.ready_body()["circuits"]) is on


@pytest.mark.parametrize("on", [True, False])
def test_admission_switch(make_cluster: FakeClusterFactory, on: bool) -> None:
    """One slot, no queue, a request holding it: the next is shed (429) only with admission."""
    cluster = make_cluster(
        "vllm-mooncake",
        features={"admission": on},
        admission={"max_concurrent_requests": 1, "max_queued_requests": 0},
        config=lambda: FakeConfig(check_kv=False),
    )
    decode = cluster.decodes[0]
    decode.config.headers_delay = 1.0
    with cluster.client() as first, cluster.client() as second:
        held = threading.Thread(target=lambda: first.post("/v1/completions", json=COMPLETION))
        held.start()
        wait_until(lambda: len(decode.records) == 1, 5, "the first request at the decode")
        decode.config.headers_delay = 0.0
        status = second.post("/v1/completions", json=COMPLETION).status_code
        held.join(10)
    assert status == (429 if on else 200)
