"""``router doctor URL`` (``GET /admin/diagnosis``) against simulated clusters: a clean one has
no finding, and each cause injected alone (a knob of the simulated engine, or a router setting
that disagrees with it) is named, with its evidence and remedy."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.kv_cache.event_feed import FeedStats
from router.observability.agreement import AgreementBoard
from router.observability.diagnosis import diagnose
from router.observability.pair_ledger import PairLedger
from router.server.doctor import doctor, render
from testkit.polling import wait_until
from tests.router.observability.test_routing_agreement import (
    PREFIX,
    complete,
    precise_cluster,
    tokenizer_dir,
    until_judged,
    warm_turns,
    without_bos,
)
from tests.router.observability.test_routing_states import Feed, _prefill, _states, _transitions
from tests.worker.cache_cluster import CacheCluster, free_port_run

__all__ = ["tokenizer_dir"]  # the fixture, shared


def ask(cluster: CacheCluster) -> tuple[int, str]:
    out = io.StringIO()
    status = doctor([cluster.router], out=out)
    return status, out.getvalue()


def causes(cluster: CacheCluster) -> list[str]:
    data = httpx.get(f"{cluster.router}/admin/diagnosis", timeout=5).json()
    return [finding["cause"] for finding in data["findings"]]


def chat(cluster: CacheCluster, text: str) -> None:
    body = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    answer = httpx.post(f"{cluster.router}/v1/chat/completions", json=body, timeout=20)
    assert answer.status_code == 200, answer.text


def test_a_clean_cluster_has_no_finding(tokenizer_dir: Path) -> None:
    with precise_cluster(tokenizer_dir) as cluster:
        warm_turns(cluster)
        status, text = ask(cluster)
    assert status == 0, text
    assert "rank 0: EXACT - KV events flowing; predictions agree" in text
    assert text.endswith("No finding: routing predicts what the engines find.\n")


def test_a_different_block_size_is_named(tokenizer_dir: Path) -> None:
    with precise_cluster(tokenizer_dir, observability={"engine_block_size": 32}) as cluster:
        warm_turns(cluster, turns=2)
        status, text = ask(cluster)
    assert status == 1
    assert (
        "FINDING block_size_mismatch: the KV events report blocks of 16 tokens; "
        "--engine-block-size is 32\n    remedy: start the engine with the block size"
    ) in text


def test_a_different_tokenizer_is_named(tokenizer_dir: Path, tmp_path: Path) -> None:
    other = without_bos(tokenizer_dir, tmp_path / "other")
    with precise_cluster(tokenizer_dir, router_tokenizer=other) as cluster:
        warm_turns(cluster, turns=6)
        assert causes(cluster) == ["tokenization_mismatch"]
        status, text = ask(cluster)
    assert status == 1
    assert (
        "FINDING tokenization_mismatch: the router's token count differs from the engine's "
        "usage.prompt_tokens for 5 of 5 completions prompts"
    ) in text


def test_a_different_chat_template_is_named(tokenizer_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "template"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|end|>", "\n<|end|>")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with precise_cluster(tokenizer_dir, router_tokenizer=other) as cluster:
        warm_turns(cluster, turns=4)  # completions prompts: the same counts
        for turn in range(4):
            chat(cluster, PREFIX + " chat" * turn)
        assert causes(cluster) == ["chat_template_mismatch"]
        _, text = ask(cluster)
    assert "for 4 of 4 chat prompts, not for its 3 completions prompts" in text


def test_hits_below_prediction_are_named(tokenizer_dir: Path) -> None:
    with precise_cluster(tokenizer_dir, prefill={"rehash_each_request": True}) as cluster:
        warm_turns(cluster)
        assert causes(cluster) == ["hits_below_prediction"]
        status, text = ask(cluster)
    assert status == 1
    assert "rank 0: DEGRADED - predictions off" in text
    assert "FINDING hits_below_prediction: KV events arrive, yet over the last 6 requests" in text
    assert "PYTHONHASHSEED" in text


def test_silent_events_are_named(tokenizer_dir: Path) -> None:
    # the router follows an event port nobody publishes on; the engine caches all the same
    with precise_cluster(tokenizer_dir, prefill={"kv_events": None}) as cluster:
        warm_turns(cluster, events=False)
        until_judged(cluster, "no KV event received yet")  # the stream is followed
        assert causes(cluster) == ["events_silent"]
        status, text = ask(cluster)
    assert status == 1
    assert "FALLBACK - no KV event received yet" in text
    assert "FINDING events_silent: no KV event ever arrived, yet the engine reported" in text


def test_unreported_cached_tokens_are_named(tokenizer_dir: Path) -> None:
    with precise_cluster(tokenizer_dir, prefill={"report_cached_tokens": False}) as cluster:
        warm_turns(cluster)
        assert causes(cluster) == ["cached_tokens_unreported"]
        _, text = ask(cluster)
    assert "agreement over the last 6 requests: no cached tokens reported" in text
    assert "--enable-prompt-tokens-details" in text


def test_prompts_shorter_than_a_block_are_named(tokenizer_dir: Path) -> None:
    with precise_cluster(tokenizer_dir) as cluster:
        warm_turns(cluster, turns=2)
        for turn in range(6):
            complete(cluster, f"hi {turn}")
        assert causes(cluster) == ["prompts_shorter_than_a_block"]
        _, text = ask(cluster)
    assert "6 of the last 8 prompts are shorter than one block" in text


def test_gapped_events_and_recomputing_pairs_are_named() -> None:
    worker, feed = _prefill(), Feed()
    states = _states(worker, feed, AgreementBoard(), _transitions())
    stats = feed.stats[(worker.id, 0)] = FeedStats("tcp://127.0.0.1:5557", None, batches=1)
    stats.last_batch_at = 99.0
    states.evaluate(now=100.0)
    stats.lost, stats.purges = 2, 1
    states.evaluate(now=101.0)
    pairs = PairLedger()
    pairs.served(("p", "d"), "http://p", "http://d")
    pairs.recomputed(("p", "d"), "http://p", "http://d")
    found = [finding.as_dict() for finding in diagnose(states, pairs)]
    assert [f["cause"] for f in found] == ["events_gapped", "decode_recomputed"]
    data: dict[str, Any] = {"pools": [], "ranks": [], "findings": found}
    assert render(data).splitlines() == [
        f"prefill {worker.public_url}:",
        "  FINDING events_gapped: KV events gapped 0s ago (lost 2, publisher restarts 0, "
        "index purges 1 so far)",
        "    remedy: " + found[0]["remedy"],
        "prefill http://p -> decode http://d:",
        "  FINDING decode_recomputed: 1 of 1 requests' decode computed the prompt itself",
        "    remedy: " + found[1]["remedy"],
        "2 findings.",
    ]


def test_the_engines_metrics_name_the_block_size(tokenizer_dir: Path) -> None:
    # vLLM's vllm:cache_config_info{block_size} and its events both disagree with the setting
    observability = {"engine_block_size": 32}
    with precise_cluster(tokenizer_dir, observability=observability, engine="vllm-mooncake") as c:
        warm_turns(c, turns=2)
        wait_until(lambda: "vllm:cache_config_info" in ask(c)[1], 10.0, "the engine's block size")
        _, text = ask(c)
    assert (
        "FINDING block_size_mismatch: the KV events report blocks of 16 tokens; "
        "vllm:cache_config_info says 16 tokens; --engine-block-size is 32"
    ) in text


def test_an_engine_that_reports_no_cached_tokens_is_judged_by_its_counters(
    tokenizer_dir: Path,
) -> None:
    # no cached tokens per request, and the engine never finds its blocks: its own
    # prefix-cache counters (sglang:cached_tokens_total / prompt_tokens_total) say so
    prefill = {"report_cached_tokens": False, "rehash_each_request": True}
    with precise_cluster(tokenizer_dir, prefill=prefill) as cluster:
        warm_turns(cluster)
        wait_until(lambda: "hits_below_prediction" in causes(cluster), 10.0, "the counters read")
        status, text = ask(cluster)
    assert status == 1
    assert "the engine's own counters say 0.0% of" in text
    assert "FINDING cached_tokens_unreported" in text


@pytest.mark.parametrize(
    ("predicted", "tokenizes", "expected"),
    [
        (0, True, ["hits_above_prediction"]),  # the index misses what the engine holds
        (160, False, ["no_token_ids"]),  # precise needs token ids
    ],
)
def test_window_and_setting_causes_are_named(
    predicted: int, tokenizes: bool, expected: list[str]
) -> None:
    worker, feed, board = _prefill(), Feed(), AgreementBoard()
    stats = feed.stats[(worker.id, 0)] = FeedStats("tcp://127.0.0.1:5557", None, batches=1)
    stats.last_batch_at = 99.0
    rank = board.rank(worker.id, 0, worker.public_url)
    for _ in range(4):
        rank.record(predicted, 160, 200, 200, False, True)
    states = _states(worker, feed, board, _transitions(), tokenizes=tokenizes)
    states.evaluate(now=100.0)
    assert [finding.cause for finding in diagnose(states, PairLedger())] == expected


def test_load_only_routing_is_no_finding() -> None:
    worker, feed, board = _prefill(), Feed(), AgreementBoard()
    states = _states(worker, feed, board, _transitions(), predicts=False)
    states.evaluate(now=100.0)
    assert diagnose(states, PairLedger()) == []


def test_the_command_exits_2_when_it_cannot_ask() -> None:
    port = free_port_run(1)
    done = subprocess.run(
        [sys.executable, "-m", "router", "doctor", f"http://127.0.0.1:{port}", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"router doctor: cannot ask http://127.0.0.1:{port}/admin/")
