"""The prefix cache through the real router: a shared prefix is computed once, reported as
cached tokens, published as KV events per DP rank, and visible as engine load."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.polling import wait_until
from tests.worker.cache_cluster import (
    SHAPE,
    CacheCluster,
    cache_cluster,
    events_config,
    free_port_run,
)
from transfer.events import AllBlocksCleared, BlockStored, KVEventSubscriber, ReceivedBatch

PREFIX = "".join(random.Random(3).choice("abcdefghij klmnop") for _ in range(1200))  # 75 pages


def _post(url: str, body: dict[str, Any], timeout: float = 20.0) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": "sim-model", "max_tokens": 8, **body},
        timeout=timeout,
    )


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _cached(answer: dict[str, Any]) -> int:
    cached: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _reported_hit(cluster: CacheCluster, hit: int, prompt: str) -> int:
    """The cached_tokens a routed answer reports for a prefill cache hit of ``hit`` tokens: the
    hit itself (SGLang, as the prefill counted it), or with vLLM's Mooncake decode its own count
    of tokens it did not compute: all of them (one token per byte)."""
    return len(prompt) if cluster.prefill.config.protocol == "vllm-mooncake" else hit


def _timed(url: str, prompt: str) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    answer = _ok(_post(url, {"prompt": prompt}))
    return answer, time.monotonic() - started


@pytest.fixture(params=["sglang", "vllm-mooncake"])
def slow(request: pytest.FixtureRequest) -> Iterator[CacheCluster]:
    """1P1D whose prefill computes 0.4 ms per uncached prompt token."""
    with cache_cluster(request.param, prefill={"compute_s_per_token": 0.0004}) as cluster:
        yield cluster


def test_a_shared_prefix_is_computed_once(slow: CacheCluster) -> None:
    stats = slow.prefill.ranks[0].stats
    first_prompt = PREFIX + " first tail of fifty tokens, more or less."
    first, first_s = _timed(slow.router, first_prompt)
    computed = stats.computed_tokens
    second_prompt = PREFIX + " the second tail: another fifty tokens or so!"
    second, second_s = _timed(slow.router, second_prompt)
    assert _cached(first) == _reported_hit(slow, 0, first_prompt)
    # the whole prefix, in full pages
    assert _cached(second) == _reported_hit(slow, 1200, second_prompt)
    assert stats.computed_tokens - computed == len(second_prompt) - 1200
    assert second_s < first_s  # 1245 x 0.4 ms of forward time against 45 x 0.4 ms
    reference = _ok(_post(slow.reference, {"prompt": second_prompt}))
    assert second["choices"][0]["text"] == reference["choices"][0]["text"]
    assert _cached(reference) == 0  # the co-located engine had not seen the prefix
    wait_until(slow.idle, 5.0, "rooms closed and pages unreferenced")


def test_the_streamed_usage_reports_cached_tokens(slow: CacheCluster) -> None:
    _ok(_post(slow.router, {"prompt": PREFIX + " warm"}))
    prompt = PREFIX + " streamed"
    body = {"model": "sim-model", "prompt": prompt, "stream": True, "max_tokens": 4}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{slow.router}/v1/completions", json=body, timeout=20) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=lines[-1][6:]).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == _reported_hit(slow, 1200, prompt)
    wait_until(slow.idle, 5.0, "rooms closed and pages unreferenced")


def _created(answer: dict[str, Any]) -> int:
    created: int = answer["usage"]["prompt_tokens_details"]["created_cache_tokens"]
    return created


def test_vllm_prefill_leg_reports_its_own_cached_tokens() -> None:
    with cache_cluster("vllm-mooncake") as cluster:
        _ok(_post(cluster.router, {"prompt": PREFIX + " warm"}))
        chat = httpx.post(
            f"{cluster.router}/v1/chat/completions",
            json={
                "model": "sim-model",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": PREFIX}],
            },
            timeout=20,
        )
        assert _created(_ok(chat)) == 0  # the decode computed nothing: PD happened
        metrics = httpx.get(f"{cluster.router}/metrics", timeout=5).text
        recomputes = [
            s.value
            for f in text_string_to_metric_families(metrics)
            for s in f.samples
            if s.name == "pdr_pd_recompute_total"
        ]
        assert recomputes == [0.0]
        prompt, transfer = PREFIX + " by hand", {"transfer_id": "xfer-1"}
        leg = _post(
            cluster.prefill_url,
            {
                "prompt": prompt,
                "max_tokens": 1,
                "kv_transfer_params": transfer | {"do_remote_decode": True},
            },
        )
        assert _cached(_ok(leg)) == 1200
        assert "created_cache_tokens" not in leg.json()["usage"]["prompt_tokens_details"]
        decode = _post(
            cluster.decode_url,
            {
                "prompt": prompt,
                "kv_transfer_params": transfer
                | {
                    "do_remote_prefill": True,
                    "remote_engine_id": cluster.prefill.config.engine_id,
                    "remote_bootstrap_addr": f"http://127.0.0.1:{cluster.bootstrap}",
                },
            },
        )
        answer = _ok(decode)
        assert _cached(answer) == len(prompt)  # Mooncake: the decode's own count, all received
        assert answer["usage"]["kv_bytes_received"] > 0
        reference = _ok(_post(cluster.reference, {"prompt": prompt}))
        assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
        wait_until(cluster.idle, 5.0, "rooms closed and pages unreferenced")


# --- KV events per DP rank ------------------------------------------------------------------


async def _until_cleared(sub: KVEventSubscriber, reset: str) -> list[ReceivedBatch]:
    """Every batch up to an ``AllBlocksCleared`` (resetting the cache until one arrives live;
    earlier batches a slow-joining SUB missed come through replay)."""
    got: list[ReceivedBatch] = []
    async with httpx.AsyncClient() as client:
        for _ in range(50):
            assert (await client.post(reset)).status_code == 200
            with contextlib.suppress(TimeoutError):
                while True:
                    got.append(await sub.next(timeout=0.2))
                    if isinstance(got[-1].batch.events[-1], AllBlocksCleared):
                        return got
    raise AssertionError(f"no AllBlocksCleared after 50 resets; got {got}")


async def test_each_dp_rank_publishes_on_its_own_port() -> None:
    live, replay = free_port_run(2), free_port_run(2)
    options = {"kv_events": events_config(live, replay)}
    prompts = [f"{i}: " + PREFIX[i * 40 : i * 40 + 100] for i in range(12)]
    with cache_cluster("sglang", dp=2, prefill=options) as cluster:
        assert cluster.prefill.event_endpoints == [
            (f"tcp://127.0.0.1:{live + r}", f"tcp://127.0.0.1:{replay + r}") for r in (0, 1)
        ]
        async with contextlib.AsyncExitStack() as stack:
            subs = [
                await stack.enter_async_context(
                    KVEventSubscriber(
                        f"tcp://127.0.0.1:{live + r}",
                        replay_endpoint=f"tcp://127.0.0.1:{replay + r}",
                        start_seq=0,
                    )
                )
                for r in (0, 1)
            ]
            async with httpx.AsyncClient(timeout=20) as client:
                body = {"model": "sim-model", "max_tokens": 2}
                for prompt in prompts:
                    answer = await client.post(
                        f"{cluster.router}/v1/completions", json={**body, "prompt": prompt}
                    )
                    assert answer.status_code == 200, answer.text
            reset = f"{cluster.prefill_url}/reset_prefix_cache"
            batches = [await _until_cleared(sub, reset) for sub in subs]
    stored: list[str] = []
    for rank, got in enumerate(batches):
        assert {b.batch.data_parallel_rank for b in got} == {rank}
        assert [b.seq for b in got] == list(range(len(got)))  # nothing lost
        for event in (e for b in got for e in b.batch.events if isinstance(e, BlockStored)):
            assert event.parent_block_hash is None and event.block_size == SHAPE.page_size
            stored.append(bytes(event.token_ids).decode())
    assert len([b for b in batches[0] if isinstance(b.batch.events[0], BlockStored)]) >= 1
    assert len([b for b in batches[1] if isinstance(b.batch.events[0], BlockStored)]) >= 1
    assert sorted(stored) == sorted(p[: len(p) // 16 * 16] for p in prompts)  # each once


# --- load while the prefill is busy ---------------------------------------------------------


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=2).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("sglang:num_")
    }


def test_a_busy_prefill_reports_running_and_waiting_requests() -> None:
    options = {"compute_s_per_token": 0.002, "chunk_tokens": 64}
    with cache_cluster("sglang", prefill=options) as cluster:
        seen: dict[str, Any] = {}

        def busy() -> bool:
            gauges = _gauges(cluster.prefill_url)
            loads = httpx.get(f"{cluster.prefill_url}/v1/loads", timeout=2).json()
            seen.update(gauges=gauges, loads=loads)
            return gauges["sglang:num_running_reqs"] == 1 and gauges["sglang:num_queue_reqs"] >= 1

        prompts = [PREFIX[i : i + 320] + str(i) for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            running = [pool.submit(_post, cluster.router, {"prompt": p}) for p in prompts]
            wait_until(busy, 5.0, "one request in the forward pass, others waiting", interval=0.02)
            for future in running:
                _ok(future.result(timeout=20))
        entry = seen["loads"]["loads"][0]
        assert entry["num_running_reqs"] == 1 and entry["num_waiting_reqs"] >= 1
        assert entry["num_total_tokens"] > entry["num_used_tokens"]  # prompt tokens to compute
        wait_until(cluster.idle, 5.0, "idle")
        assert _gauges(cluster.prefill_url)["sglang:num_running_reqs"] == 0
        assert httpx.get(f"{cluster.prefill_url}/v1/loads").json()["aggregate"]["total_reqs"] == 0
