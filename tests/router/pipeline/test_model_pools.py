"""Several models behind one router (``router.scheduling.model_pools``), with real routers and
fake engines that each serve one model and refuse any other (404, as vLLM does): every request
reaches its model's workers, learned from their ``/v1/models`` or declared on the command line;
an alias reaches its model under the served name; an unknown model is a 404 naming the served
ones; ``/v1/models`` lists each model once with its pools; round robin turns per pool."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.errors import ModelNotFound
from router.scheduling.model_pools import ModelPools
from router.schemas import Endpoint, parse_request
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until


def _two_models() -> Callable[[], FakeConfig]:
    """Configs for 2 prefills then 2 decodes: worker i of each role serves model a or b."""
    names = itertools.cycle(["a", "b"])
    return lambda: FakeConfig(kv_timeout=20.0, model=next(names))


def _declared(make_cluster: FakeClusterFactory, engine: str, **policy: Any) -> FakeCluster:
    """2 prefills and 2 decodes, worker i of each role serving model a or b, declared."""
    return make_cluster(
        engine, prefill=2, decode=2, config=_two_models(), declare_models=["a", "b"], policy=policy
    )


def _complete(cluster: FakeCluster, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 3}
    return httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=10)


def _served(cluster: FakeCluster) -> list[str]:
    answer = httpx.get(cluster.router_url + "/v1/models", timeout=5).json()
    return [entry["id"] for entry in answer.get("data", [])]


def _check_each_model_reaches_its_own_workers(cluster: FakeCluster) -> None:
    for _ in range(3):  # round robin would alternate the workers of a single pool
        for model in ("a", "b"):
            response = _complete(cluster, model)
            assert response.status_code == 200, response.text
            assert response.headers["x-pdr-model"] == model
    for engine in (*cluster.prefills, *cluster.decodes):
        assert engine.records, "every worker served its model's requests"
        assert {r.body["model"] for r in engine.records} == {engine.config.model}


def test_workers_are_pooled_by_the_models_their_v1_models_lists(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake", prefill=2, decode=2, config=_two_models())
    wait_until(lambda: _served(cluster) == ["a", "b"], 10, "the router to learn both models")
    _check_each_model_reaches_its_own_workers(cluster)
    unknown = _complete(cluster, "c")
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert "'c'" in error["message"] and "served: a, b" in error["message"]
    answer = httpx.get(cluster.router_url + "/v1/models", timeout=5).json()
    pools = {entry["id"]: (entry["prefill"], entry["decode"]) for entry in answer["data"]}
    assert pools["a"] == ([cluster.prefill_urls[0]], [cluster.decode_urls[0]])
    assert pools["b"] == ([cluster.prefill_urls[1]], [cluster.decode_urls[1]])


def test_declared_models_and_an_alias_route_without_asking_the_engines(
    make_cluster: FakeClusterFactory,
) -> None:
    """``model=NAME`` on the worker specs (the router never reads /v1/models then) and
    ``--model-alias``: the engines get the served name."""
    cluster = _declared(make_cluster, "sglang", model_aliases={"latest": "b"})
    _check_each_model_reaches_its_own_workers(cluster)
    response = _complete(cluster, "latest")
    assert response.status_code == 200, response.text
    assert cluster.prefills[1].records[-1].body["model"] == "b"
    assert _served(cluster) == ["a", "b", "latest"]


def test_a_fleet_whose_workers_name_no_model_is_one_pool() -> None:
    """No worker names a model: every request goes to the fleet's chooser, whatever its model
    (the router before model pools)."""
    pool: Any = type("Pool", (), {"models": frozenset(), "wildcards": True})()
    default: Any = object()
    pools = ModelPools(pool, default, lambda model: pytest.fail("no pool is made"), {})
    request = parse_request(Endpoint.COMPLETIONS, b'{"model": "x", "prompt": "p"}')
    assert pools.chooser_for(request) is default


def test_a_model_only_unnamed_workers_could_serve_goes_to_them_and_no_pool_is_made_per_name() -> (
    None
):
    made: list[str | None] = []
    pool: Any = type("Pool", (), {"models": frozenset({"a"}), "wildcards": True})()

    def new_chooser(model: str | None) -> Any:
        made.append(model)
        return object()

    default: Any = object()
    pools = ModelPools(pool, default, new_chooser, {})
    for name in ("x", "y", "z", "a", "a"):
        pools.chooser_for(
            parse_request(Endpoint.COMPLETIONS, f'{{"model": "{name}", "prompt": "p"}}'.encode())
        )
    assert made == ["", "a"]  # one chooser for any unknown name, one for the served "a"
    pool.wildcards = False
    with pytest.raises(ModelNotFound):
        pools.chooser_for(parse_request(Endpoint.COMPLETIONS, b'{"model": "x", "prompt": "p"}'))


def test_a_worker_registered_through_the_admin_api_declares_its_models(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake")
    wait_until(lambda: _served(cluster) == ["fake-model"], 10, "the router to learn the model")
    url = "http://127.0.0.1:9"  # never healthy: its declaration alone is checked
    body = {"role": "decode", "url": url, "models": ["z"]}
    added = httpx.post(cluster.router_url + "/admin/workers", json=body, timeout=5)
    assert added.status_code == 201, added.text
    wait_until(lambda: _served(cluster) == ["fake-model", "z"], 10, "the declared model")
    # served by a worker that is down: no healthy one (503), not an unknown model (404)
    assert _complete(cluster, "z").status_code == 503
    assert _complete(cluster, "fake-model").status_code == 200
    too_many = {"role": "decode", "url": url, "models": [str(i) for i in range(65)]}
    refused = httpx.post(cluster.router_url + "/admin/workers", json=too_many, timeout=5)
    assert refused.status_code == 400


def test_a_worker_that_comes_back_serving_another_model_is_pooled_anew(
    make_cluster: FakeClusterFactory,
) -> None:
    """An engine restarted with another model: its /v1/models is read again when it comes
    back, and requests for the new model reach it (the old name is no longer served)."""
    cluster = make_cluster("vllm-mooncake", prefill=2, decode=2, config=_two_models())
    wait_until(lambda: _served(cluster) == ["a", "b"], 10, "the router to learn both models")
    for engine in (cluster.prefills[1], cluster.decodes[1]):
        engine.config.health_status = 503

    def second_pair(healthy: bool) -> bool:  # asked without requests (a worker serving
        ready = cluster.ready_body()  # them is not marked down by failed probes)
        return ready["prefill"][1]["healthy"] is ready["decode"][1]["healthy"] is healthy

    wait_until(lambda: second_pair(healthy=False), 10, "b's workers to be marked down")
    assert _complete(cluster, "b").status_code == 503
    for engine in (cluster.prefills[1], cluster.decodes[1]):
        engine.config.model, engine.config.health_status = "c", 200
    wait_until(lambda: _served(cluster) == ["a", "c"], 10, "the router to learn model c")
    wait_until(lambda: second_pair(healthy=True), 10, "the workers back up")
    response = _complete(cluster, "c")
    assert response.status_code == 200 and response.headers["x-pdr-model"] == "c"
    assert _complete(cluster, "b").status_code == 404


def test_pass_through_routes_go_to_the_pool_of_their_model(
    make_cluster: FakeClusterFactory,
) -> None:
    """``/tokenize`` and ``/detokenize`` reach a worker serving the body's model (its alias as
    the served name); a model no worker serves is a 404 naming those served, and no model at
    all a 400, since the workers' tokenizers differ."""
    cluster = _declared(make_cluster, "vllm-mooncake", model_aliases={"latest": "b"})
    url = cluster.router_url
    for model in ("a", "b", "a", "b", "latest"):
        answer = httpx.post(url + "/tokenize", json={"model": model, "prompt": "hi"}, timeout=10)
        assert answer.status_code == 200, answer.text
    assert len(cluster.prefills[0].passthrough_calls) == 2
    assert len(cluster.prefills[1].passthrough_calls) == 3
    unknown = httpx.post(url + "/detokenize", json={"model": "c", "tokens": [104]}, timeout=10)
    assert unknown.status_code == 404
    assert "served: a, b, latest" in unknown.json()["error"]["message"]
    unnamed = httpx.post(url + "/tokenize", json={"prompt": "hi"}, timeout=10)
    assert unnamed.status_code == 400 and "'model'" in unnamed.json()["error"]["message"]
    assert sum(len(engine.passthrough_calls) for engine in cluster.prefills) == 5


def test_a_model_policy_sets_its_pools_policy_and_the_others_keep_the_fleets(
    make_cluster: FakeClusterFactory,
) -> None:
    """``--model-policy a=cache_aware``: model a's pool routes its prefills by cache (its
    decodes by load), model b's keeps ``--policy round_robin``."""
    cluster = _declared(
        make_cluster, "vllm-mooncake", policy="round_robin", model_policies={"a": "cache_aware"}
    )

    def policies(model: str) -> Any:
        body = {"model": model, "prompt": "hello", "max_tokens": 3}
        answer = httpx.post(cluster.router_url + "/admin/explain", json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()["policy"]

    assert policies("a") == {"prefill": "cache_aware", "decode": "least_load"}
    assert policies("b") == {"prefill": "round_robin", "decode": "round_robin"}
    _check_each_model_reaches_its_own_workers(cluster)


def test_metrics_and_receipts_carry_the_pool_and_only_served_names(
    make_cluster: FakeClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """``pdr_model_requests_total{model}``, ``pdr_model_responses_total{model,status}`` and
    ``pdr_model_ttft_seconds{model}`` count each pool's requests and make no series for a name
    no worker serves; the receipt (``x-pdr-model``, its log line) names the pool."""
    cluster = _declared(make_cluster, "vllm-mooncake")
    caplog.set_level(logging.DEBUG, logger="router.observability.request_accounting")
    for model in ("a", "a", "b", "c", "d"):
        _complete(cluster, model)
    body = {"model": "b", "prompt": "hello", "max_tokens": 3, "stream": True}
    streamed = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=10)
    assert streamed.status_code == 200
    metrics = httpx.get(cluster.router_url + "/metrics", timeout=5).text
    samples = [s for family in text_string_to_metric_families(metrics) for s in family.samples]

    def by_labels(name: str, *labels: str) -> dict[tuple[str, ...], float]:
        return {tuple(s.labels[k] for k in labels): s.value for s in samples if s.name == name}

    assert by_labels("pdr_model_requests_total", "model") == {("a",): 2, ("b",): 2}
    responses = by_labels("pdr_model_responses_total", "model", "status")
    assert responses == {("a", "200"): 2, ("b", "200"): 2}
    assert by_labels("pdr_model_ttft_seconds_count", "model") == {("b",): 1}
    logged = [r.getMessage() for r in caplog.records if "status=200" in r.getMessage()]
    assert sorted(line.rsplit("model=", 1)[-1] for line in logged) == ["a", "a", "b", "b"]


def test_a_prefix_cached_for_one_model_never_attracts_another_models_request(
    make_cluster: FakeClusterFactory,
) -> None:
    """``cache_aware``: a's prefill holds (by prediction) a long prompt's blocks; the same
    prompt for model b still goes to b's prefill, and a's requests keep going to a's."""
    cluster = _declared(make_cluster, "vllm-mooncake", policy="cache_aware")
    prompt = "a long shared system prompt, the same for both models. " * 20

    def prefill_of(model: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 3}
        answer = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-pdr-prefill"]

    assert [prefill_of("a") for _ in range(3)] == [cluster.prefill_urls[0]] * 3
    assert [prefill_of("b") for _ in range(2)] == [cluster.prefill_urls[1]] * 2


def test_an_unknown_models_404_carries_openais_code_and_param(
    make_cluster: FakeClusterFactory,
) -> None:
    """OpenAI's answer to a model it does not serve: ``code: "model_not_found"``, ``param:
    "model"``, type ``invalid_request_error``."""
    cluster = _declared(make_cluster, "vllm-mooncake")
    body = {"model": "c", "prompt": "hello", "max_tokens": 3}
    answer = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=10)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert error["type"] == "invalid_request_error" and "served: a, b" in error["message"]
    assert not any(engine.records for engine in (*cluster.prefills, *cluster.decodes))
