"""Predicted against actual cache hits, end to end: a simulated prefill that publishes KV events
and reports its cached tokens per request, a router routing on them (precise ``cache_aware``,
the same tokenizer), and what the router makes of it: ``/admin/explain``'s agreement per rank,
the ``pdr_cache_*`` metrics and the request's debug log line."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.polling import wait_until
from testkit.tokenizer_dir import build_tokenizer_dir
from tests.worker.cache_cluster import CacheCluster, cache_cluster, events_config, free_port_run

PREFIX = "".join(chr(97 + (i * 7) % 26) for i in range(600))  # 37 full 16-token pages


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@contextlib.contextmanager
def precise_cluster(
    tokenizer: Path,
    *,
    prefill: dict[str, Any] | None = None,
    router_tokenizer: Path | None = None,
    observability: dict[str, Any] | None = None,
    engine: str = "sglang",
) -> Iterator[CacheCluster]:
    """1P1D of simulated workers speaking ``engine``; the prefill publishes KV events, the
    router follows them and tokenizes with ``router_tokenizer`` (default: the engines' own)."""
    live, replay = free_port_run(1), free_port_run(1)
    router = {
        "policy": {"policy": "cache_aware"},
        "cache": {
            "tokenizer": str(router_tokenizer or tokenizer),
            "kv_events_port": live,
            "kv_events_replay_port": replay,
        },
        "observability": {"agreement_min_requests": 4, **(observability or {})},
        "load": {"interval_s": 0.2},  # the engines' counters, read with their load
    }
    options = {"kv_events": events_config(live, replay), **(prefill or {})}
    with cache_cluster(
        engine, prefill=options, common={"tokenizer": str(tokenizer)}, router_settings=router
    ) as cluster:
        yield cluster


def complete(cluster: CacheCluster, prompt: str) -> httpx.Response:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    answer = httpx.post(f"{cluster.router}/v1/completions", json=body, timeout=20)
    assert answer.status_code == 200, answer.text
    return answer


def explain_agreement(cluster: CacheCluster) -> list[dict[str, Any]]:
    body = {"model": "sim-model", "prompt": "x"}
    answer = httpx.post(f"{cluster.router}/admin/explain", json=body, timeout=5)
    assert answer.status_code == 200, answer.text
    rows: list[dict[str, Any]] = answer.json()["agreement"]
    return rows


def samples(url: str, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


def warm_turns(cluster: CacheCluster, turns: int = 6, *, events: bool = True) -> None:
    """A conversation's turns: each prompt extends the last, so all but the first hit;
    ``events``: wait for the prefill's KV events before the second turn."""
    complete(cluster, PREFIX)
    for turn in range(1, turns):
        # the events of the turn before arrive before the next is routed: a precise prediction
        if events:
            wait_until(lambda: _indexed(cluster), 5.0, "the prefill's KV events indexed")
        complete(cluster, PREFIX + " turn" * turn)


def until_judged(cluster: CacheCluster, reason: str) -> dict[str, Any]:
    """The prefill rank's routing state on ``/ready`` once its reason mentions ``reason``."""

    def judged() -> dict[str, Any] | None:
        ranks = httpx.get(f"{cluster.router}/ready", timeout=5).json()["routing"]["ranks"]
        return next((rank for rank in ranks if reason in rank["reason"]), None)

    wait_until(lambda: judged() is not None, 10.0, f"a routing state saying {reason!r}")
    found = judged()
    assert found is not None
    return found


def without_bos(tokenizer: Path, path: Path) -> Path:
    """A copy of ``tokenizer`` that does not prepend ``<s>``: one token fewer per prompt."""
    shutil.copytree(tokenizer, path)
    config = json.loads((path / "tokenizer.json").read_text())
    config["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(config))
    return path


def _indexed(cluster: CacheCluster) -> bool:
    stats = samples(cluster.router, "pdr_kv_index_blocks")
    return any(value > 0 for value in stats.values())


def receipts(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The request receipts logged (``router.observability.request_accounting``, DEBUG)."""
    return [r.getMessage() for r in caplog.records if "cached=" in r.getMessage()]


def test_a_clean_cluster_predicts_what_the_engine_finds(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with precise_cluster(tokenizer_dir) as cluster:
        with caplog.at_level(logging.DEBUG, "router.observability.request_accounting"):
            warm_turns(cluster)
            # logged as each request ends in the router: the last may end just after its
            # client read the answer
            wait_until(lambda: len(receipts(caplog)) >= 6, 5.0, "six requests' receipts logged")
        [row] = explain_agreement(cluster)
        assert row["worker"] == cluster.prefill_url and row["dp_rank"] == 0
        assert row["requests"] == row["reported"] == 6
        assert row["cached_tokens"] > 0  # the engine found the earlier turns cached
        assert row["error_ratio"] <= 0.05, row  # ... as much as the router predicted
        assert row["predicted_hit_rate"] == pytest.approx(row["actual_hit_rate"], abs=0.05)
        # the first turn went before any event (approximate): no exact count of its own
        assert row["token_count_compared"] == 5 and row["token_count_differs"] == 0
        labels = (("dp_rank", "0"), ("worker", cluster.prefill_url))
        metrics = samples(cluster.router, "pdr_cache_")
        assert metrics[("pdr_cache_actual_tokens_total", labels)] == row["cached_tokens"]
        assert (
            metrics[("pdr_cache_predicted_tokens_total", labels)] == row["predicted_cached_tokens"]
        )
        assert metrics[("pdr_cache_prompt_tokens_total", labels)] == row["prompt_tokens"]
        assert metrics[("pdr_cache_prediction_error_ratio_count", labels)] == 6
        within = (*labels[:1], ("le", "0.05"), *labels[1:])
        assert metrics[("pdr_cache_prediction_error_ratio_bucket", within)] == 6
        rank = until_judged(cluster, "predictions agree")
        assert rank["state"] == "exact"
        state = samples(cluster.router, "pdr_routing_")
        assert state[("pdr_routing_state", (*labels[:1], ("state", "exact"), *labels[1:]))] == 1
        assert state[("pdr_routing_pool_state", (("pool", "sim-model"), ("state", "exact")))] == 1

    # each request's receipt: the engine's cached tokens / the predicted ones
    lines = receipts(caplog)
    assert len(lines) == 6
    actual, predicted = lines[-1].split("cached=")[1].split()[0].split("/")
    assert int(actual) > 0 and abs(int(actual) - int(predicted)) <= 16


def test_a_different_tokenizer_shows_as_miscounted_prompts(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    other = without_bos(tokenizer_dir, tmp_path / "other")
    with precise_cluster(tokenizer_dir, router_tokenizer=other) as cluster:
        warm_turns(cluster, turns=4)
        [row] = explain_agreement(cluster)
        assert row["token_count_compared"] == 3
        assert row["token_count_differs"] == 3


def test_an_engine_whose_hits_stay_below_prediction_is_degraded(tokenizer_dir: Path) -> None:
    # events arrive, yet the engine never finds its blocks again (another hash seed per request)
    with precise_cluster(tokenizer_dir, prefill={"rehash_each_request": True}) as cluster:
        warm_turns(cluster)
        [row] = explain_agreement(cluster)
        assert row["cached_tokens"] == 0 and row["predicted_cached_tokens"] > 0
        rank = until_judged(cluster, "predictions off")
        assert rank["state"] == "degraded"
        pools = httpx.get(f"{cluster.router}/ready", timeout=5).json()["routing"]["pools"]
        assert [(p["pool"], p["state"]) for p in pools] == [("sim-model", "degraded")]
        transitions = samples(cluster.router, "pdr_routing_state_transitions")
        assert (
            transitions[
                ("pdr_routing_state_transitions_total", (("scope", "rank"), ("to", "degraded")))
            ]
            == 1
        )
