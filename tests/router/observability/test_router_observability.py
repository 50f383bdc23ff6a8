"""The router's own observability: ``/metrics``, routing receipts, ``/admin/explain``, the
per-request debug line and "PD did not happen" detection, against fake engines on 127.0.0.1."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.observability.logs import RequestIdFilter
from testkit.fake_cluster import FakeClusterFactory
from testkit.fake_engine import EngineProtocol, FakeConfig
from testkit.polling import wait_until

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(metrics: dict[Any, float], name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def scrape(client: httpx.Client) -> dict[Any, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return samples(response.text)


def test_metrics_count_requests_by_status_and_time_every_stage(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake")
    # a real decode's first byte waits for the KV, so for the prefill's answer; the fake decode
    # does not wait, and a stream it ended before the prefill answered has no KV wait to observe
    cluster.decodes[0].config.headers_delay = 0.2
    with cluster.client() as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 400
        metrics = scrape(client)
    requests = "pdr_requests_total"
    completions, chat = "/v1/completions", "/v1/chat/completions"
    assert value(metrics, requests, endpoint=completions, status="200", stream="false") == 1
    assert value(metrics, requests, endpoint=chat, status="200", stream="true") == 1
    assert value(metrics, requests, endpoint=completions, status="400", stream="false") == 1
    duration = "pdr_request_duration_seconds_count"
    assert value(metrics, duration, endpoint=completions, stream="false") == 2
    assert value(metrics, "pdr_ttft_seconds_count", endpoint=chat) == 1  # streams only
    assert value(metrics, "pdr_prefill_duration_seconds_count") == 2
    assert value(metrics, "pdr_kv_wait_seconds_count") == 1  # the stream's
    decisions = "pdr_routing_decisions_total"
    assert value(metrics, decisions, policy="round_robin", outcome="round_robin") == 2
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    assert value(metrics, "pdr_worker_healthy", role="prefill", worker=prefill) == 1
    assert value(metrics, "pdr_worker_inflight", role="decode", worker=decode) == 0
    assert value(metrics, "pdr_pd_requests_total", prefill=prefill, decode=decode) == 2
    assert value(metrics, "pdr_pd_recompute_total", prefill=prefill, decode=decode) == 0
    assert value(metrics, "pdr_registry_up") == 1


def test_upstream_errors_and_retries_are_counted_by_role_and_kind(
    make_cluster: FakeClusterFactory,
) -> None:
    health = {"interval_s": 60.0, "failure_threshold": 100}  # stays in rotation
    cluster = make_cluster("vllm-nixl", prefill=2, health=health)  # prefill, then decode
    cluster.stop("prefill", 0)  # refuses connections: each attempt there is retried
    cluster.decodes[0].config.fail_status = 500
    with cluster.client() as client:
        for _ in range(2):
            assert client.post("/v1/completions", json=COMPLETION).status_code == 500
        metrics = scrape(client)
    errors = "pdr_upstream_errors_total"
    assert value(metrics, errors, role="decode", kind="http_5xx") == 2
    # round robin (one turn per choice, retries too) starts both requests at the stopped one
    assert value(metrics, errors, role="prefill", kind="connect") == 2
    assert value(metrics, "pdr_retries_total", role="prefill") == 2
    live = (cluster.prefill_urls[1], cluster.decode_urls[0])
    assert value(metrics, "pdr_pd_errors_total", prefill=live[0], decode=live[1]) == 2


def test_a_worker_that_leaves_takes_its_series_with_it(
    make_cluster: FakeClusterFactory,
) -> None:
    """A decode added through the admin API (the one engine under a second name: command-line
    workers belong to their router and come back) serves, then is removed: its series go."""
    cluster = make_cluster("sglang")
    gone = cluster.decode_urls[0].replace("127.0.0.1", "localhost")
    with cluster.client() as client:
        added = client.post("/admin/workers", json={"role": "decode", "url": gone})
        assert added.status_code == 201, added.text
        wait_until(lambda: _healthy(client, gone), 5.0, "the added decode healthy")
        for _ in range(4):  # round robin: both decodes serve, both pairs exist
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        before = client.get("/metrics").text
        assert f'worker="{gone}"' in before and f'decode="{gone}"' in before
        assert client.delete(f"/admin/workers/{added.json()['id']}").status_code == 204
        wait_until(lambda: gone not in client.get("/metrics").text, 5.0, "series of the gone")
        assert f'worker="{cluster.decode_urls[0]}"' in client.get("/metrics").text


def _healthy(client: httpx.Client, url: str) -> bool:
    return any(w["url"] == url and w["healthy"] for w in client.get("/ready").json()["decode"])


def test_every_response_names_its_route(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("vllm-mooncake", prefill=2, dp_size=2)
    with cluster.client() as client:
        for body in (COMPLETION, {**CHAT, "stream": True}):
            response = client.post(
                "/v1/chat/completions" if "messages" in body else "/v1/completions", json=body
            )
            assert response.status_code == 200
            served = [i for i, p in enumerate(cluster.prefills) if p.records]
            prefill = cluster.prefills[served[-1]]
            assert response.headers["x-pdr-prefill"] == cluster.prefill_urls[served[-1]]
            assert int(response.headers["x-pdr-prefill-dp-rank"]) in prefill.records[-1].dp_ranks
            assert response.headers["x-pdr-decode"] == cluster.decode_urls[0]
            assert response.headers["x-pdr-attempts"] == "1"
            assert int(response.headers["x-pdr-route-us"]) > 0
            for p in cluster.prefills:
                p.records.clear()


def test_a_retried_request_says_how_many_attempts_it_took(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster(
        "sglang", prefill=2, health={"interval_s": 60.0, "failure_threshold": 100}
    )
    with cluster.client() as client:
        first = client.post("/v1/completions", json=COMPLETION)
        cluster.stop("prefill", 1)
        # round robin (a turn per choice, retries too) starts the next at the stopped one
        retried = client.post("/v1/completions", json=COMPLETION)
    assert first.headers["x-pdr-attempts"] == "1"
    assert retried.status_code == 200 and retried.headers["x-pdr-attempts"] == "2"
    assert retried.headers["x-pdr-prefill"] == cluster.prefill_urls[0]


def test_explain_shows_candidates_and_choice_without_sending_anything(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster(
        "vllm-mooncake", prefill=2, dp_size=2, policy={"prefill_policy": "cache_aware"}
    )
    long_chat = {
        **CHAT,
        "messages": [{"role": "user", "content": "a long shared question " * 40}],
    }
    with cluster.client() as client:
        assert client.post("/v1/chat/completions", json=long_chat).status_code == 200
        served = next(i for i, p in enumerate(cluster.prefills) if p.records)
        rank = cluster.prefills[served].records[0].dp_ranks[0]
        records = [len(e.records) for e in (*cluster.prefills, *cluster.decodes)]
        explained = client.post("/admin/explain", json=long_chat)
        assert explained.status_code == 200, explained.text
        bad = client.post("/admin/explain", json={"messages": "not a list"})
    assert [len(e.records) for e in (*cluster.prefills, *cluster.decodes)] == records
    body = explained.json()
    assert body["endpoint"] == "/v1/chat/completions"
    candidates = body["prefill_candidates"]
    assert len(candidates) == 4  # 2 prefills x 2 DP ranks
    cached = {(c["worker"], c["dp_rank"]): c["predicted_cached_tokens"] for c in candidates}
    home = (cluster.prefill_urls[served], rank)
    assert cached[home] > 0 and all(v == 0 for k, v in cached.items() if k != home)
    assert body["choice"]["prefill"] == home[0] and body["choice"]["dp_rank"] == home[1]
    assert body["choice"]["decode"] == cluster.decode_urls[0]
    assert body["choice"]["outcome"] == "approximate"
    assert [d["worker"] for d in body["decode_candidates"]] == cluster.decode_urls
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_explain_needs_the_admin_token(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", registry={"admin_token": "s3cret"})
    with cluster.client() as client:
        assert client.post("/admin/explain", json=COMPLETION).status_code == 401
        authorized = client.post(
            "/admin/explain", json=COMPLETION, headers={"authorization": "Bearer s3cret"}
        )
    assert authorized.status_code == 200
    assert authorized.json()["choice"]["prefill"] == cluster.prefill_urls[0]


def test_debug_log_has_one_line_per_request_with_its_route(
    make_cluster: FakeClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = make_cluster("sglang")
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.DEBUG, logger="router.observability.request_accounting")
    with cluster.client() as client:
        response = client.post(
            "/v1/completions", json=COMPLETION, headers={"x-request-id": "receipt-1"}
        )
    assert response.status_code == 200

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "router.observability.request_accounting"]

    # the line is written once the request has ended, which may be just after the client has
    # read the last byte
    wait_until(lambda: len(lines()) >= 1, 5, "the request's debug line")
    assert len(lines()) == 1
    line = lines()[0]
    assert getattr(line, "request_id", None) == "receipt-1"
    message = line.getMessage()
    assert f"prefill={cluster.prefill_urls[0]} dp_rank=0" in message
    assert f"decode={cluster.decode_urls[0]}" in message
    assert "status=200" in message and "attempts=1" in message and "prefill_leg=" in message


# vLLM 0.32: the Mooncake decode's cached_tokens is its own count (the router wrote its
# kv_transfer_params); NIXL's is the prefill's hits, so only created_cache_tokens (chat) tells
@pytest.mark.parametrize(
    ("engine", "path", "stream"),
    [
        ("vllm-mooncake", "/v1/completions", False),
        ("vllm-mooncake", "/v1/completions", True),
        ("vllm-nixl", "/v1/chat/completions", False),
        ("vllm-nixl", "/v1/chat/completions", True),
    ],
)
def test_a_decode_that_recomputes_the_prompt_marks_its_pair_suspect(
    make_cluster: FakeClusterFactory,
    caplog: pytest.LogCaptureFixture,
    engine: EngineProtocol,
    path: str,
    stream: bool,
) -> None:
    cluster = make_cluster(
        engine,
        decode=2,
        config=lambda: FakeConfig(kv_timeout=20.0, prompt_tokens_details=True),
    )
    cluster.decodes[1].config.recompute_prompt = True  # PD silently does nothing there
    body: dict[str, Any] = {**(CHAT if "chat" in path else COMPLETION), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    caplog.set_level(logging.WARNING, logger="router.pipeline")
    with cluster.client() as client:
        for _ in range(4):  # round robin: two requests per decode
            assert client.post(path, json=body).status_code == 200
        metrics = scrape(client)
        ready = client.get("/ready").json()
    prefill, good, bad = cluster.prefill_urls[0], *cluster.decode_urls
    assert value(metrics, "pdr_pd_recompute_total", prefill=prefill, decode=bad) == 2
    assert value(metrics, "pdr_pd_recompute_total", prefill=prefill, decode=good) == 0
    assert value(metrics, "pdr_pd_pair_suspect", prefill=prefill, decode=bad) == 1
    assert value(metrics, "pdr_pd_pair_suspect", prefill=prefill, decode=good) == 0
    assert [(p["prefill"], p["decode"]) for p in ready["suspect_pairs"]] == [(prefill, bad)]
    warnings = [r.getMessage() for r in caplog.records if "PD did not happen" in r.getMessage()]
    assert len(warnings) == 2 and all(prefill in w and bad in w for w in warnings)


def test_nixl_cached_tokens_alone_do_not_claim_a_recompute(
    make_cluster: FakeClusterFactory,
) -> None:
    """A NIXL decode's cached_tokens are the prefill's cache hits (0 for a cold prompt): a
    completions answer, which has no created_cache_tokens, proves nothing either way."""
    cluster = make_cluster("vllm-nixl", config=lambda: FakeConfig(prompt_tokens_details=True))
    cluster.decodes[0].config.recompute_prompt = True  # cached_tokens 0, as for a cold prompt
    with cluster.client() as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        metrics = scrape(client)
    pair = {"prefill": cluster.prefill_urls[0], "decode": cluster.decode_urls[0]}
    assert value(metrics, "pdr_pd_requests_total", **pair) == 1
    assert value(metrics, "pdr_pd_recompute_total", **pair) == 0


def test_a_stream_without_include_usage_is_not_given_usage(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake", config=lambda: FakeConfig(prompt_tokens_details=True))
    cluster.decodes[0].config.recompute_prompt = True
    with cluster.client() as client:
        response = client.post("/v1/completions", json={**COMPLETION, "stream": True})
        metrics = scrape(client)
    assert response.status_code == 200 and '"usage"' not in response.text
    # nothing asked for usage, so nothing could be checked: no recompute is claimed
    assert "stream_options" not in cluster.decodes[0].records[0].body
    pair = {"prefill": cluster.prefill_urls[0], "decode": cluster.decode_urls[0]}
    assert value(metrics, "pdr_pd_recompute_total", **pair) == 0


def test_event_loop_tasks_are_exported_and_return_to_idle(
    make_cluster: FakeClusterFactory,
) -> None:
    """``pdr_event_loop_tasks`` counts the router's asyncio tasks (what the soak checks for
    leaks): requests add tasks while they run, and the count comes back once they ended."""
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        idle = value(scrape(client), "pdr_event_loop_tasks")
        assert idle is not None and idle >= 1
        for index in range(10):
            body = {**COMPLETION, "stream": bool(index % 2)}
            assert client.post("/v1/completions", json=body).status_code == 200
        wait_until(
            lambda: (value(scrape(client), "pdr_event_loop_tasks") or 0) <= idle,
            5,
            "the router's task count back at its idle level",
        )
