"""The router's HTTP surface: bad input is a 4xx OpenAI error, health/readiness, models."""

from __future__ import annotations

import httpx
import pytest

from router import create_app
from testkit.fake_cluster import FakeClusterFactory, settings_for
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import run_server
from tests.router.pipeline.test_protocols import COMPLETION


@pytest.mark.parametrize(
    ("path", "content", "status", "needle"),
    [
        ("/v1/completions", b"{oops", 400, "not valid JSON"),
        ("/v1/completions", b"[1,2]", 400, "JSON object"),
        ("/v1/completions", b"", 400, "empty"),
        ("/v1/completions", b'{"prompt": "x"}', 400, "'model'"),
        ("/v1/completions", b'{"model": "m"}', 400, "'prompt'"),
        ("/v1/chat/completions", b'{"model": "m"}', 400, "'messages'"),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', 400, "'messages'"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "n": -1}', 400, "'n'"),
    ],
)
def test_bad_input_gets_openai_error_and_reaches_no_engine(
    make_cluster: FakeClusterFactory, path: str, content: bytes, status: int, needle: str
) -> None:
    cluster = make_cluster("sglang")
    response = httpx.post(
        cluster.router_url + path,
        content=content,
        timeout=5,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == status
    assert cluster.prefills[0].records == [] and cluster.decodes[0].records == []


def test_oversized_body_is_413(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", server={"max_body_bytes": 1000})
    big = {**COMPLETION, "prompt": "x" * 2000}
    response = httpx.post(cluster.router_url + "/v1/completions", json=big, timeout=5)
    assert response.status_code == 413
    assert "limit" in response.json()["error"]["message"]

    def chunks():  # no content-length: the limit is enforced while reading
        yield b'{"model": "m", "prompt": "'
        for _ in range(20):
            yield b"y" * 100
        yield b'"}'

    response = httpx.post(cluster.router_url + "/v1/completions", content=chunks(), timeout=5)
    assert response.status_code == 413
    assert cluster.prefills[0].records == []


def test_vllm_rejects_batched_prompts_with_400(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("vllm-mooncake")
    response = httpx.post(
        cluster.router_url + "/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]}, timeout=5
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


def test_wrong_method_and_unknown_path(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    response = httpx.get(cluster.router_url + "/v1/completions", timeout=5)
    assert response.status_code == 405 and response.json()["error"]["code"] == 405
    response = httpx.get(cluster.router_url + "/v2/nothing", timeout=5)
    assert response.status_code == 404 and response.json()["error"]["code"] == 404


def test_models_are_those_the_workers_serve(make_cluster: FakeClusterFactory) -> None:
    """Each worker's /v1/models, read when it joined (router.scheduling.model_pools)."""
    names = iter(["fake-model", "fake-model", "other-model"])  # the prefill, then two decodes
    cluster = make_cluster("sglang", decode=2, config=lambda: FakeConfig(model=next(names)))

    def listed() -> list[str]:
        response = httpx.get(cluster.router_url + "/v1/models", timeout=5)
        assert response.status_code == 200
        return sorted(m["id"] for m in response.json()["data"])

    wait_until(lambda: listed() == ["fake-model", "other-model"], 10, "both models listed")


def test_ready_follows_worker_health() -> None:
    prefill, decode = FakeEngine("prefill", "sglang"), FakeEngine("decode", "sglang")
    with run_server(prefill.app) as p_port, run_server(prefill.bootstrap_app) as b_port:
        decode_server = run_server(decode.app)
        d_port = decode_server.__enter__()
        try:
            settings = settings_for(
                "sglang", [(f"http://127.0.0.1:{p_port}", b_port)], [f"http://127.0.0.1:{d_port}"]
            )
            with run_server(create_app(settings)) as r_port:
                url = f"http://127.0.0.1:{r_port}"
                assert httpx.get(url + "/health", timeout=5).status_code == 200
                wait_until(lambda: httpx.get(url + "/ready").status_code == 200, 5, "ready")
                decode_server.__exit__(None, None, None)
                wait_until(lambda: httpx.get(url + "/ready").status_code == 503, 5, "not ready")
                body = httpx.get(url + "/ready").json()
                assert body["status"] == "not_ready" and body["decode"][0]["healthy"] is False
                assert httpx.get(url + "/health", timeout=5).status_code == 200
                response = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=5)
                assert response.status_code == 503
                assert response.json()["error"]["type"] == "service_unavailable"
                with run_server(decode.app, port=d_port):
                    wait_until(
                        lambda: httpx.get(url + "/ready").status_code == 200,
                        5,
                        "ready again once the decode is back",
                    )
        finally:
            decode_server.__exit__(None, None, None)


def test_router_without_workers_is_alive_but_not_ready() -> None:
    with run_server(create_app(settings_for("sglang", [], []))) as port:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/ready").status_code == 503
        response = httpx.post(
            url + "/v1/chat/completions",
            timeout=5,
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
        assert response.status_code == 503
        assert "no healthy prefill" in response.json()["error"]["message"]
        assert httpx.get(url + "/v1/models").status_code == 503
