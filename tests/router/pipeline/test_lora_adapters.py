"""Workers serving a base model and LoRA adapters (listed in their ``/v1/models`` with a
``parent``, as vLLM and SGLang list them): the router learns which names are adapters, and an
adapter's request never counts the base model's cached prefix (the engines key an adapter's
blocks apart), while the base model's requests still find it."""

from __future__ import annotations

from typing import Any

import httpx

from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until

PROMPT = "a long system prompt shared by the base model and its adapter. " * 8


def _served(cluster: FakeCluster) -> list[str]:
    answer = httpx.get(cluster.router_url + "/v1/models", timeout=5).json()
    return sorted(entry["id"] for entry in answer.get("data", []))


def _predicted(cluster: FakeCluster, model: str) -> dict[str, Any]:
    """Each prefill's predicted cached prompt tokens for ``PROMPT`` to ``model`` (explain)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3}
    answer = httpx.post(cluster.router_url + "/admin/explain", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    return {
        row["worker"]: row["predicted_cached_tokens"] or 0
        for row in answer.json()["prefill_candidates"]
    }


def test_an_adapters_request_never_counts_the_base_models_cached_prefix(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster(
        "vllm-mooncake",
        prefill=2,
        config=lambda: FakeConfig(kv_timeout=20.0, adapters=("sql-lora",)),
        policy={"policy": "cache_aware"},
    )
    wait_until(lambda: _served(cluster) == ["fake-model", "sql-lora"], 10, "the names learned")
    status = httpx.get(cluster.router_url + "/status/data", timeout=5).json()
    workers = status["workers"]
    for worker in [*workers["prefill"], *workers["decode"]]:  # the status page shows them
        assert (worker["models"], worker["adapters"]) == (["fake-model", "sql-lora"], ["sql-lora"])
    ready = httpx.get(cluster.router_url + "/ready", timeout=5).json()
    assert all(w["adapters"] == ["sql-lora"] for w in [*ready["prefill"], *ready["decode"]])
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 3}
    answer = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    holder = answer.headers["x-pdr-prefill"]
    assert _predicted(cluster, "fake-model")[holder] > 0
    assert set(_predicted(cluster, "sql-lora").values()) == {0}
    adapted = httpx.post(
        cluster.router_url + "/v1/completions", json={**body, "model": "sql-lora"}, timeout=10
    )
    assert adapted.status_code == 200, adapted.text
    assert _predicted(cluster, "sql-lora")[adapted.headers["x-pdr-prefill"]] > 0
