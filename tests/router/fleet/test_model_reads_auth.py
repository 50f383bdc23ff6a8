"""The router's reads of its engines' ``/v1/models`` with engines behind ``--api-key`` (fake
engines that answer 401 to a ``/v1/*`` request without ``Authorization: Bearer KEY``, as vLLM
does): the health probes read with ``--engine-api-key``, so that each model's workers are
learned, in one router and in each of ``router --workers 2``'s processes; the router's own
``/v1/models``, when no model was learned, asks the decodes with the key a completion's legs
carry."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.fake_cluster import FakeClusterFactory
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_servers

KEY = "sk-team-a-0123456789abcdef"  # a client's
ENGINE_KEY = "engine-secret-0123456789"  # the engines' --api-key
CLIENT = {"authorization": f"Bearer {KEY}"}


def _keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants:\n  team-a:\n    keys: [{KEY}]\n")
    return path


def _two_models(**knobs: Any) -> Callable[[], FakeConfig]:
    """Configs for 2 prefills then 2 decodes behind ``ENGINE_KEY``: worker i of each role
    serves model a or b."""
    names = itertools.cycle(["a", "b"])
    return lambda: FakeConfig(api_key=ENGINE_KEY, model=next(names), **knobs)


def _pools(url: str) -> dict[str, tuple[int, int]]:
    """Each listed model's number of prefill and decode workers (the learned pools)."""
    with httpx.Client(base_url=url, timeout=5) as client:  # a connection of its own
        answer = client.get("/v1/models", headers=CLIENT).json()
    listed = answer.get("data", [])  # an error: none
    return {e["id"]: (len(e.get("prefill", [])), len(e.get("decode", []))) for e in listed}


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 3}
    with httpx.Client(base_url=url, timeout=10) as client:  # a connection of its own
        return client.post("/v1/completions", json=body, headers=CLIENT)


def _check_each_model_reaches_its_own_workers(url: str, engines: list[FakeEngine]) -> None:
    for _ in range(4):  # round robin over every worker would reach the other model's too
        for model in ("a", "b"):
            response = _complete(url, model)
            assert response.status_code == 200, response.text
            assert response.headers["x-pdr-model"] == model
    for engine in engines:
        assert engine.records, "every worker served its model's requests"
        assert {r.body["model"] for r in engine.records} == {engine.config.model}


def test_the_models_of_engines_behind_an_api_key_are_learned_with_the_engine_key(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    auth = {"api_keys": _keys_file(tmp_path), "engine_api_key": ENGINE_KEY}
    cluster = make_cluster(
        "vllm-mooncake", prefill=2, decode=2, config=_two_models(kv_timeout=20.0), auth=auth
    )
    both = {"a": (1, 1), "b": (1, 1)}
    wait_until(lambda: _pools(cluster.router_url) == both, 10, "the router to learn a and b")
    _check_each_model_reaches_its_own_workers(
        cluster.router_url, [*cluster.prefills, *cluster.decodes]
    )


@pytest.mark.parametrize("api_keys", [True, False], ids=["api-keys", "no-api-keys"])
def test_the_routers_model_list_asks_the_decodes_with_the_legs_key_when_none_was_learned(
    make_cluster: FakeClusterFactory, tmp_path: Path, api_keys: bool
) -> None:
    """With ``--api-keys`` the engines get ``--engine-api-key``; without, the client's own
    ``Authorization`` (the one the engines want here; the probes had none to send)."""
    config = FakeConfig(kv_timeout=20.0, api_key="another-key" if api_keys else ENGINE_KEY)
    auth = {"api_keys": _keys_file(tmp_path), "engine_api_key": ENGINE_KEY} if api_keys else {}
    cluster = make_cluster("vllm-mooncake", config=lambda: config, auth=auth)
    config.api_key = ENGINE_KEY  # the probes' reads were refused: no model was learned
    bearer = CLIENT if api_keys else {"authorization": f"Bearer {ENGINE_KEY}"}
    listed = httpx.get(cluster.router_url + "/v1/models", headers=bearer, timeout=5)
    assert listed.status_code == 200, listed.text
    assert [entry["id"] for entry in listed.json()["data"]] == ["fake-model"]
    assert "decode" not in listed.json()["data"][0], "the decode's own list, not a learned pool"


def test_every_process_of_a_supervised_router_learns_the_models_with_the_engine_key(
    tmp_path: Path,
) -> None:
    """``router --workers 2``: the leader's probes (and a follower's own, at its start) read
    with the key; each process routes each model to its own workers."""
    new_config = _two_models(check_kv=False)
    engines = [FakeEngine(role, "sglang", config=new_config()) for role in ("prefill",) * 2]
    engines += [FakeEngine("decode", "sglang", config=new_config()) for _ in range(2)]
    with run_servers(*(engine.app for engine in engines)) as ports:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "router", "--engine", "sglang", "--port", str(port)]
        argv += ["--workers", "2", "--health-interval", "0.2"]
        argv += ["--api-keys", str(_keys_file(tmp_path)), "--engine-api-key", ENGINE_KEY]
        for role, engine_port in zip(["--prefill"] * 2 + ["--decode"] * 2, ports, strict=True):
            argv += [role, f"http://127.0.0.1:{engine_port}"]
        with http_process(argv, url, path="/ready", timeout=30):
            both = {"a": (1, 1), "b": (1, 1)}
            for _ in range(6):  # each on a connection of its own: both processes answer
                wait_until(lambda: _pools(url) == both, 10, "a process to learn a and b")
            _check_each_model_reaches_its_own_workers(url, engines)
