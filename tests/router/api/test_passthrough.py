"""``/tokenize``, ``/detokenize`` and ``/v1/embeddings`` pass through to one worker (a prefill
first) in each engine's own format, under the completion routes' bounds and errors."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.fake_base import FakeConfig
from testkit.fake_cluster import FakeClusterFactory
from testkit.polling import wait_until


def post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10, **kwargs)


@pytest.mark.parametrize(
    ("engine", "tokenized", "detokenized"),
    [
        ("vllm-mooncake", {"count": 2, "max_model_len": 4096, "tokens": [104, 105]}, "prompt"),
        ("sglang", {"count": 2, "max_model_len": 4096, "tokens": [104, 105]}, "text"),
    ],
)
def test_tokenize_and_detokenize_answer_as_the_engine_does(
    make_cluster: FakeClusterFactory, engine: str, tokenized: dict[str, Any], detokenized: str
) -> None:
    cluster = make_cluster(engine)
    url = cluster.router_url
    answer = post(url, "/tokenize", {"model": "fake-model", "prompt": "hi"})
    assert answer.status_code == 200
    assert {k: answer.json()[k] for k in tokenized} == tokenized
    answer = post(url, "/detokenize", {"model": "fake-model", "tokens": [104, 105]})
    assert answer.status_code == 200 and answer.json() == {detokenized: "hi"}
    # the engine's own 4xx comes back unchanged
    answer = post(url, "/tokenize", {"model": "fake-model", "prompt": 5})
    assert answer.status_code == 400 and "prompt must be a string" in answer.text
    # on a prefill (short compute-bound work: no decode's stream waits behind it)
    assert cluster.prefills[0].passthrough_calls == ["/tokenize", "/detokenize", "/tokenize"]
    assert cluster.decodes[0].passthrough_calls == []


def test_embeddings_where_the_engine_serves_them_and_its_404_where_not(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake")
    body = {"model": "fake-model", "input": ["one", "three"]}
    answer = post(cluster.router_url, "/v1/embeddings", body)
    assert answer.status_code == 404  # a generation model serves none: the engine said so,
    assert "Not Found" in answer.json()["error"]["message"]  # in FastAPI's shape, now OpenAI's
    cluster.prefills[0].config.serves_embeddings = True
    answer = post(cluster.router_url, "/v1/embeddings", body)
    assert answer.status_code == 200
    assert [d["index"] for d in answer.json()["data"]] == [0, 1]


def test_the_decode_serves_when_no_prefill_can(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    cluster.stop("prefill", 0)  # its port refuses: the probes mark it down
    wait_until(lambda: not cluster.ready_body()["prefill"][0]["healthy"], 10, "the prefill down")
    answer = post(cluster.router_url, "/v1/tokenize", {"model": "fake-model", "prompt": "a"})
    assert answer.status_code == 200 and cluster.decodes[0].passthrough_calls == ["/v1/tokenize"]


def test_bounds_and_errors_are_the_completion_routes(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", server={"max_body_bytes": 1000})
    url = cluster.router_url
    assert httpx.get(url + "/tokenize", timeout=5).status_code == 405
    big = post(url, "/tokenize", {"prompt": "x" * 2000})
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    for bad in (b"not json", b"[1, 2]"):
        answer = httpx.post(url + "/tokenize", content=bad, timeout=5)
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert cluster.prefills[0].passthrough_calls == []  # none of them reached an engine
    post(url, "/tokenize", {"prompt": "ok"})
    counted = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        for s in family.samples
        if s.name == "pdr_requests_total"
    }
    assert counted[("/tokenize", "200")] == 1 and counted[("/tokenize", "413")] == 1


def test_admission_limits_them_too(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster(
        "sglang",
        config=lambda: FakeConfig(tokens=20, token_delay=0.1, check_kv=False),
        admission={"max_concurrent_requests": 1, "max_queued_requests": 0},
    )
    url = cluster.router_url
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"model": "fake-model", "prompt": "p", "max_tokens": 12, "stream": True},
        timeout=30,
    ) as streaming:
        assert streaming.status_code == 200
        assert post(url, "/tokenize", {"prompt": "a"}).status_code == 429
        for _ in streaming.iter_lines():
            pass
    assert post(url, "/tokenize", {"prompt": "a"}).status_code == 200


def test_a_failing_engine_is_a_502_in_openai_shape(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("vllm-mooncake")
    cluster.prefills[0].config.fail_status = 500
    answer = post(cluster.router_url, "/tokenize", {"prompt": "a"})
    assert answer.status_code == 502
    assert "answered HTTP 500: Internal Server Error" in answer.json()["error"]["message"]
    cluster.prefills[0].config.fail_status = 503  # full: the client may come back
    assert post(cluster.router_url, "/tokenize", {"prompt": "a"}).status_code == 503


def test_the_worker_caps_hold_them_too(make_cluster: FakeClusterFactory) -> None:
    """With one request in flight per worker, a prefill busy with a completion's leg passes a
    tokenization to the decode; with both busy it is a 429 that reaches no engine."""
    cluster = make_cluster(
        "sglang",
        config=lambda: FakeConfig(tokens=20, token_delay=0.1, check_kv=False),
        admission={"max_inflight_per_worker": 1},
    )
    url = cluster.router_url
    cluster.prefills[0].config.hang = True  # its leg stays in flight
    tokenize = {"model": "fake-model", "prompt": "a"}
    streamed = {"model": "fake-model", "prompt": "p", "max_tokens": 12, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=streamed, timeout=30) as streaming:
        assert streaming.status_code == 200  # SGLang: both legs run together
        busy = post(url, "/tokenize", tokenize)
        assert busy.status_code == 429, busy.text
        assert "at its limit of 1" in busy.json()["error"]["message"]
        assert cluster.prefills[0].passthrough_calls == cluster.decodes[0].passthrough_calls == []
        for _ in streaming.iter_lines():
            pass
        wait_until(lambda: cluster.ready_body()["decode"][0]["inflight"] == 0, 10, "decode free")
        assert post(url, "/tokenize", tokenize).status_code == 200
        assert cluster.decodes[0].passthrough_calls == ["/tokenize"]  # the prefill is busy
