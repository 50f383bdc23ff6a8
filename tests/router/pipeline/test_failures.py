"""Failure semantics: prompt errors, cancellation of the surviving leg, no leaked load."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from testkit.fake_cluster import FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until
from tests.router.pipeline.test_protocols import COMPLETION

CONCURRENT = ["vllm-mooncake", "sglang"]
ENGINES = ["vllm-mooncake", "vllm-nixl", "sglang"]


def _error(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    return error


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("stream", [True, False])
def test_prefill_error_reaches_client_fast_and_cancels_decode(
    make_cluster: FakeClusterFactory, engine: str, stream: bool
) -> None:
    cluster = make_cluster(engine, config=lambda: FakeConfig(kv_timeout=60.0))
    cluster.prefills[0].config.fail_status = 500
    started = time.monotonic()
    with cluster.client() as client:
        response = client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    elapsed = time.monotonic() - started
    assert elapsed < 2.0, f"client waited {elapsed:.1f}s for a failed prefill"
    assert response.status_code == 502
    assert "prefill worker" in _error(response)["message"]
    decode = cluster.decodes[0]
    if engine != "vllm-nixl":  # NIXL never sends decode when prefill fails
        # The decode leg either never got out or was cancelled; it must not keep waiting.
        wait_until(
            lambda: all(r.done and r.disconnected for r in decode.records),
            2,
            "the decode leg to be cancelled",
        )
    else:
        assert decode.records == []
    cluster.wait_idle()


@pytest.mark.parametrize("engine", ENGINES)
def test_prefill_4xx_passes_through_as_client_error(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(engine)
    cluster.prefills[0].config.fail_status = 400
    with cluster.client() as client:
        response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 400
    assert _error(response)["type"] == "invalid_request_error"
    cluster.wait_idle()


@pytest.mark.parametrize("engine", CONCURRENT)
def test_prefill_failing_after_stream_started_ends_with_sse_error_event(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    def config() -> FakeConfig:
        return FakeConfig(check_kv=False, token_delay=0.05, tokens=100)

    cluster = make_cluster(engine, config=config)
    cluster.prefills[0].config.headers_delay = 0.4
    cluster.prefills[0].config.fail_status = 503
    started = time.monotonic()
    with cluster.client() as client:
        response = client.post(
            "/v1/completions", json={**COMPLETION, "max_tokens": 100, "stream": True}
        )
    assert time.monotonic() - started < 3.0
    assert response.status_code == 200
    events = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert len(events) >= 2  # some tokens went through before the prefill failed
    last = events[-1]
    assert '"error"' in last and "prefill worker" in last
    assert "[DONE]" not in response.text
    wait_until(lambda: cluster.decodes[0].records[0].disconnected, 2, "decode cancelled")
    cluster.wait_idle()


@pytest.mark.parametrize("engine", ENGINES)
def test_prefill_timeout_returns_504_and_cancels_decode(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(engine, upstream={"prefill_timeout_s": 0.5})
    cluster.prefills[0].config.hang = True
    started = time.monotonic()
    with cluster.client() as client:
        response = client.post("/v1/completions", json=COMPLETION)
    assert time.monotonic() - started < 2.5
    assert response.status_code == 504
    wait_until(lambda: cluster.prefills[0].records[0].disconnected, 2, "prefill cancelled")
    cluster.wait_idle()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("stream", [True, False])
def test_decode_error_passes_through_with_its_status(
    make_cluster: FakeClusterFactory, engine: str, stream: bool
) -> None:
    cluster = make_cluster(engine, config=lambda: FakeConfig(check_kv=False))
    cluster.decodes[0].config.fail_status = 500
    with cluster.client() as client:
        response = client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert response.status_code == 500
    assert _error(response)
    cluster.wait_idle()


@pytest.mark.parametrize("engine", ENGINES)
def test_decode_crash_mid_stream_ends_with_sse_error_event(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(engine)
    cluster.decodes[0].config.fail_after_events = 2
    with cluster.client() as client:
        response = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert response.status_code == 200
    events = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert len(events) == 3
    assert '"error"' in events[-1] and "decode worker" in events[-1]
    cluster.wait_idle()


@pytest.mark.parametrize("engine", CONCURRENT)
def test_client_disconnect_mid_stream_cancels_both_legs(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(
        engine, config=lambda: FakeConfig(check_kv=False, token_delay=0.05, tokens=200)
    )
    cluster.prefills[0].config.hang = True  # still in flight when the client leaves
    with (
        httpx.Client(base_url=cluster.router_url, timeout=10) as client,
        client.stream(
            "POST", "/v1/completions", json={**COMPLETION, "max_tokens": 200, "stream": True}
        ) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    wait_until(lambda: decode.records[0].disconnected, 3, "decode to observe the disconnect")
    wait_until(lambda: prefill.records[0].disconnected, 3, "prefill to observe the disconnect")
    cluster.wait_idle()


def test_client_disconnect_during_sequential_prefill_cancels_it(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl")
    cluster.prefills[0].config.hang = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.router_url + "/v1/completions", json=COMPLETION, timeout=0.5)
    wait_until(lambda: cluster.prefills[0].records[0].disconnected, 3, "prefill cancelled")
    assert cluster.decodes[0].records == []
    cluster.wait_idle()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_connect_error_retries_on_another_worker(
    make_cluster: FakeClusterFactory, engine: str, role: str
) -> None:
    cluster = make_cluster(engine, prefill=2, decode=2, health={"interval_s": 60.0})
    cluster.stop(role, 0)  # healthy at the router, but its port now refuses connections
    with cluster.client() as client:
        for _ in range(4):
            response = client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200, response.text
    live = cluster.prefills[1] if role == "prefill" else cluster.decodes[1]
    assert len(live.records) == 4
    cluster.wait_idle()


@pytest.mark.parametrize("engine", ENGINES)
def test_only_worker_down_gives_502_promptly_then_marks_it_unhealthy(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(engine, health={"interval_s": 60.0, "failure_threshold": 2})
    cluster.stop("decode", 0)
    with cluster.client() as client:
        started = time.monotonic()
        response = client.post("/v1/completions", json=COMPLETION)
        assert time.monotonic() - started < 2.0
        assert response.status_code == 502
        assert "cannot connect" in _error(response)["message"]
        wait_until(
            lambda: not cluster.ready_body()["decode"][0]["healthy"],
            2,
            "the decode to be marked unhealthy after consecutive failures",
        )
        response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 503
    assert "no healthy decode worker" in _error(response)["message"]
    cluster.wait_idle()
