"""Client API keys (``--api-keys``) through a real router and fake engines: a request without a
key or with an unknown one is a 401 that reaches no engine; a known one is served, and the
engines get the router's own credentials (``--engine-api-key``), never the client's; Anthropic
clients' ``x-api-key`` works on ``/v1/messages``; ``/v1/models`` and the pass-through routes
need a key too; a changed keys file is picked up while the router serves, and SIGHUP rereads
it in a real router process."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import pytest

from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_server

KEY = "sk-team-a-0123456789abcdef"
OTHER = "sk-team-b-0123456789abcdef"
ENGINE_KEY = "engine-secret-0123456789"
COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}
MESSAGE = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 3,
}


def _keys(path: Path, *keys: str) -> Path:
    listed = ", ".join(keys)
    path.write_text(f"tenants:\n  team-a:\n    keys: [{listed}]\n")
    return path


@pytest.fixture
def cluster(make_cluster: FakeClusterFactory, tmp_path: Path) -> FakeCluster:
    keys = _keys(tmp_path / "keys.yaml", KEY)
    auth = {"api_keys": keys, "engine_api_key": ENGINE_KEY, "reload_interval_s": 0.1}
    return make_cluster("vllm-mooncake", auth=auth)


def _post(cluster: FakeCluster, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(cluster.router_url + path, json=body, headers=headers, timeout=10)


def _engine_requests(cluster: FakeCluster) -> int:
    return len(cluster.prefills[0].records) + len(cluster.decodes[0].records)


@pytest.mark.parametrize(
    "authorization", [None, f"Bearer {OTHER}", KEY, "Basic dXNlcjpwYXNz", "Bearer " + "x" * 5000]
)
def test_no_key_or_an_unknown_one_is_a_401_that_reaches_no_engine(
    cluster: FakeCluster, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    response = _post(cluster, "/v1/completions", COMPLETION, **headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert error["code"] == 401 and KEY not in error["message"] and OTHER not in error["message"]
    assert _engine_requests(cluster) == 0


def test_a_known_key_is_served_and_the_engines_get_the_routers_credentials(
    cluster: FakeCluster,
) -> None:
    response = _post(cluster, "/v1/completions", COMPLETION, authorization=f"Bearer {KEY}")
    assert response.status_code == 200, response.text
    for engine in (cluster.prefills[0], cluster.decodes[0]):
        assert [r.headers.get("authorization") for r in engine.records] == [f"Bearer {ENGINE_KEY}"]
    metrics = httpx.get(cluster.router_url + "/metrics", timeout=5).text
    assert 'pdr_tenant_requests_total{tenant="team-a"} 1.0' in metrics


def test_anthropic_clients_send_x_api_key_on_messages(cluster: FakeCluster) -> None:
    assert _post(cluster, "/v1/messages", MESSAGE, **{"x-api-key": KEY}).status_code == 200
    # only there: an OpenAI route wants the Authorization header
    assert _post(cluster, "/v1/completions", COMPLETION, **{"x-api-key": KEY}).status_code == 401


def test_models_and_pass_through_routes_need_a_key_too(cluster: FakeCluster) -> None:
    url = cluster.router_url
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
    listed = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=5)
    assert listed.status_code == 200
    tokenize = {"model": "fake-model", "prompt": "hello"}
    assert _post(cluster, "/tokenize", tokenize).status_code == 401
    assert _post(cluster, "/tokenize", tokenize, authorization=f"Bearer {KEY}").status_code == 200
    assert httpx.get(url + "/health", timeout=5).status_code == 200  # operators' routes: open


def test_a_changed_keys_file_is_picked_up_while_serving(
    cluster: FakeCluster, tmp_path: Path
) -> None:
    bearer = {"authorization": f"Bearer {OTHER}"}
    assert _post(cluster, "/v1/completions", COMPLETION, **bearer).status_code == 401
    _keys(tmp_path / "keys.yaml", KEY, OTHER)
    wait_until(
        lambda: _post(cluster, "/v1/completions", COMPLETION, **bearer).status_code == 200,
        10,
        "the new key to be accepted",
    )
    (tmp_path / "keys.yaml").write_text("tenants: oops\n")  # broken: the last good keys stay
    assert _post(cluster, "/v1/completions", COMPLETION, **bearer).status_code == 200


def test_sighup_rereads_the_keys_file_in_a_router_process(tmp_path: Path) -> None:
    keys = _keys(tmp_path / "keys.yaml", KEY)
    prefill, decode = FakeEngine("prefill", "vllm-mooncake"), FakeEngine("decode", "vllm-mooncake")
    with (
        run_server(prefill.app) as p_port,
        run_server(prefill.bootstrap_app) as b_port,
        run_server(decode.app) as d_port,
    ):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "router",
            "--prefill", f"http://127.0.0.1:{p_port}", str(b_port),
            "--decode", f"http://127.0.0.1:{d_port}",
            "--engine", "vllm-mooncake", "--port", str(port), "--health-interval", "0.2",
            "--api-keys", str(keys), "--api-keys-reload-interval", "3600",
        ]  # fmt: skip
        with http_process(argv, url, path="/ready", timeout=15) as process:
            bearer = {"authorization": f"Bearer {OTHER}"}

            def status() -> int:
                answer = httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer)
                return answer.status_code

            assert status() == 401
            _keys(keys, KEY, OTHER)
            process.send_signal(signal.SIGHUP)
            wait_until(lambda: status() == 200, 10, "SIGHUP to reload the keys")
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=15)
    assert process.returncode == 0, output
    assert "API keys reloaded" in output and KEY not in output and OTHER not in output
