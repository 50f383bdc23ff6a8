"""An engine saying it is full (429/503, e.g. SGLang's KV pool) is busy, not broken: the request
goes to another worker, the full one is avoided for a moment (capacity back-off) but stays
healthy and in rotation. Real faults still take a worker out, and the router says so in its
log."""

from __future__ import annotations

import logging

import pytest

from testkit.fake_cluster import FakeClusterFactory

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}


def healthy(body: dict[str, list[dict[str, object]]], role: str) -> list[object]:
    return [w["healthy"] for w in body[role]]


@pytest.mark.parametrize("engine", ["vllm-nixl", "vllm-mooncake"])
def test_a_full_prefill_sends_requests_elsewhere_and_stays_in_rotation(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(
        engine,
        prefill=2,
        health={"failure_threshold": 2},
        admission={"capacity_backoff_s": 60.0},  # longer than the test: no second visit
    )
    cluster.prefills[0].config.fail_status = 503
    with cluster.client() as client:
        statuses = [client.post("/v1/completions", json=COMPLETION).status_code for _ in range(6)]
        metrics = client.get("/metrics").text
    assert statuses == [200] * 6
    assert len(cluster.prefills[0].records) == 1  # asked once; full: then avoided
    assert healthy(cluster.ready_body(), "prefill") == [True, True]
    assert 'pdr_upstream_errors_total{kind="capacity",role="prefill"} 1.0' in metrics
    assert 'pdr_retries_total{role="prefill"} 1.0' in metrics


def test_a_full_decode_sends_requests_to_another(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", decode=2, health={"failure_threshold": 2})
    cluster.decodes[1].config.fail_status = 503
    with cluster.client() as client:
        statuses = [client.post("/v1/completions", json=COMPLETION).status_code for _ in range(4)]
        streamed = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert statuses == [200] * 4
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert healthy(cluster.ready_body(), "decode") == [True, True]


def test_when_every_decode_is_full_the_client_gets_503(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", health={"failure_threshold": 2})
    cluster.decodes[0].config.fail_status = 503
    with cluster.client() as client:
        responses = [client.post("/v1/completions", json=COMPLETION) for _ in range(3)]
    for response in responses:
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
        assert response.headers["retry-after"] == "1"
    assert healthy(cluster.ready_body(), "decode") == [True]  # full, not broken


def test_a_worker_taken_out_by_failing_requests_is_logged(
    make_cluster: FakeClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = make_cluster("sglang", health={"failure_threshold": 2, "interval_s": 60.0})
    cluster.decodes[0].config.fail_status = 500
    caplog.set_level(logging.WARNING, logger="router.fleet.circuit_breaker")
    with cluster.client() as client:
        for _ in range(2):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 500
    lines = [r.getMessage() for r in caplog.records if r.name == "router.fleet.circuit_breaker"]
    assert lines == [
        f"circuit of decode worker {cluster.decode_urls[0]} is now open: 2 requests in a row "
        "failed (last: HTTP 500: fake engine configured to fail with HTTP 500); next trial in 5s"
    ]
