"""What a co-located pd-worker tells a router: KV cache events, ``/metrics``, ``/v1/loads``,
cached tokens in ``usage``, and token ids from a Hugging Face tokenizer directory.

Each test serves one ``--role both`` worker with a small pool on the test's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from testkit.servers import arun_server
from testkit.tokenizer_dir import build_tokenizer_dir
from tests.worker.cache_cluster import events_config
from transfer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventSubscriber,
)
from worker.__main__ import build, parse_args
from worker.app import SimWorker, WorkerConfig, create_app
from worker.block_hash import sglang_block_keys, vllm_block_hasher
from worker.kv import PoolShape

SMALL = PoolShape(layers=2, page_size=16, bytes_per_token=64, pages=12)
A = "".join(chr(97 + (i * 7) % 26) for i in range(100))  # 6 full pages + 4 tokens
B = A[:64] + "B" * 40  # shares 4 pages with A
C = "C" * 100  # needs 7 pages: evicts 3
SMALL_WIDE = PoolShape(layers=2, page_size=16, bytes_per_token=64, pages=64)


@contextlib.asynccontextmanager
async def serve(**config: Any) -> AsyncIterator[tuple[httpx.AsyncClient, SimWorker]]:
    worker = SimWorker(WorkerConfig("both", **{"shape": SMALL, **config}), None)
    async with (
        arun_server(create_app(worker)) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
    ):
        yield client, worker


async def complete(client: httpx.AsyncClient, prompt: str, **body: Any) -> dict[str, Any]:
    response = await client.post(
        "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 4, **body}
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def cached(answer: dict[str, Any]) -> int:
    value: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


async def samples(client: httpx.AsyncClient) -> dict[tuple[str, tuple[str, ...]], float]:
    """Every sample of ``/metrics``, keyed by name and label values (``model_name`` dropped)."""
    text = (await client.get("/metrics")).text
    return {
        (s.name, tuple(v for k, v in sorted(s.labels.items()) if k != "model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# --- KV events ------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["sglang", "vllm-mooncake"])
async def test_kv_events_follow_the_prefix_cache(protocol: str) -> None:
    async with serve(protocol=protocol, hash_seed="7", kv_events=events_config()) as (
        client,
        worker,
    ):
        [(live, replay)] = worker.event_endpoints
        health = (await client.get("/health")).json()
        assert health["kv_events"] == [{"endpoint": live, "replay": replay}]
        async with KVEventSubscriber(live, replay_endpoint=replay, start_seq=0) as sub:
            assert cached(await complete(client, A)) == 0
            assert cached(await complete(client, B)) == 64
            assert cached(await complete(client, C)) == 0
            events = await _until_cleared(client, sub)
    hasher = sglang_block_keys if protocol == "sglang" else vllm_block_hasher("7")
    a_keys = [k.event_id for k in hasher([ord(c) for c in A], 16)]
    b_keys = [k.event_id for k in hasher([ord(c) for c in B], 16)]
    stored_a, stored_b, removed, stored_c, cleared = events[:5]
    assert stored_a == BlockStored(
        block_hashes=a_keys, parent_block_hash=None, token_ids=list(A[:96].encode()),
        block_size=16, lora_id=None,
    )  # fmt: skip
    assert stored_b == BlockStored(
        block_hashes=b_keys[4:], parent_block_hash=a_keys[3], token_ids=list(B[64:96].encode()),
        block_size=16, lora_id=None,
    )  # fmt: skip
    # C's allocation evicted 3 cached pages: the least recently released, tails first
    assert removed == BlockRemoved(block_hashes=[a_keys[5], a_keys[4], b_keys[5]])
    assert isinstance(stored_c, BlockStored) and stored_c.token_ids == list(C[:96].encode())
    assert cleared == AllBlocksCleared()


async def _until_cleared(client: httpx.AsyncClient, sub: KVEventSubscriber) -> list[KVEvent]:
    """The events up to an ``AllBlocksCleared``, resetting until one arrives live (batches a
    slow-joining SUB missed are replayed)."""
    events: list[KVEvent] = []
    for _ in range(50):
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        with contextlib.suppress(TimeoutError):
            while not events or not isinstance(events[-1], AllBlocksCleared):
                events += (await sub.next(timeout=0.2)).batch.events
            return events
    raise AssertionError(f"no AllBlocksCleared after 50 resets: {events}")


async def test_a_cleared_cache_is_computed_again() -> None:
    async with serve() as (client, worker):
        await complete(client, A)
        assert cached(await complete(client, A)) == 96
        assert (await client.post("/flush_cache")).status_code == 200
        assert worker.pool.cache.cached_pages == 0
        assert cached(await complete(client, A)) == 0


# --- /metrics and /v1/loads -----------------------------------------------------------------


async def test_vllm_metrics_count_prefix_cache_tokens() -> None:
    async with serve(protocol="vllm-mooncake", model="m") as (client, _):
        await complete(client, A)
        await complete(client, B)
        got = await samples(client)
    engine = ("0",)
    assert got[("vllm:prefix_cache_queries_total", engine)] == len(A) + len(B)
    assert got[("vllm:prefix_cache_hits_total", engine)] == 64  # tokens, not requests
    assert got[("vllm:prompt_tokens_by_source_total", ("0", "local_compute"))] == 100 + 40
    assert got[("vllm:prompt_tokens_by_source_total", ("0", "local_cache_hit"))] == 64
    assert got[("vllm:time_to_first_token_seconds_count", engine)] == 2
    assert got[("vllm:num_requests_running", engine)] == 0
    assert got[("vllm:num_requests_waiting", engine)] == 0
    assert got[("vllm:kv_cache_usage_perc", engine)] == 0  # cached pages nobody uses are free


async def test_a_streaming_request_runs_until_its_client_leaves() -> None:
    async with serve(protocol="vllm-mooncake", decode_s_per_token=0.5) as (client, _):
        body = {"model": "m", "prompt": A, "max_tokens": 8, "stream": True}
        running = ("vllm:num_requests_running", ("0",))
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert (await anext(response.aiter_lines())).startswith("data: ")
            assert (await samples(client))[running] == 1
        # the client left after one token of eight: the request ends with its connection
        deadline = asyncio.get_running_loop().time() + 5.0
        while (await samples(client))[running] != 0:
            assert asyncio.get_running_loop().time() < deadline, "still running"
            await asyncio.sleep(0.02)  # poll interval


async def test_sglang_metrics_and_loads() -> None:
    async with serve(protocol="sglang", model="m") as (client, _):
        await complete(client, A)
        await complete(client, B)
        got = await samples(client)
        loads = await client.get("/v1/loads", params={"include": "core,queues,memory,disagg"})
        bad = await client.get("/v1/loads", params={"include": "core,nonsense"})
        rank0 = await client.get("/v1/loads", params={"dp_rank": 0, "include": "core"})
    rank = ("0",)
    assert got[("sglang:prompt_tokens_total", rank)] == 204
    assert got[("sglang:cached_tokens_total", rank)] == 64
    assert got[("sglang:cache_hit_rate", rank)] == pytest.approx(64 / 204)
    assert got[("sglang:num_running_reqs", rank)] == 0
    assert got[("sglang:num_queue_reqs", rank)] == 0
    assert got[("sglang:token_usage", rank)] == 0
    assert bad.status_code == 400
    report = loads.json()
    assert report["dp_rank_count"] == 1 and report["aggregate"]["total_reqs"] == 0
    [entry] = report["loads"]
    assert entry["dp_rank"] == 0 and entry["num_running_reqs"] == entry["num_waiting_reqs"] == 0
    assert entry["max_total_num_tokens"] == SMALL.pages * SMALL.page_size
    assert entry["cache_hit_rate"] == pytest.approx(64 / 204)
    assert entry["queues"]["waiting"] == 0 and entry["disaggregation"]["mode"] == "null"
    assert entry["memory"]["token_capacity"] == 192
    assert rank0.json()["loads"][0]["queues"] is None  # only the core section asked for


# --- --tokenizer ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok") / "tokenizer")


async def test_tokenizer_dir_tokenizes_like_the_tokenizers_library(tokenizer_dir: Path) -> None:
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    template = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|assistant|>" in template
    prompt = "The licence grants permission to copy, modify and distribute. " * 12
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does the licence permit?"},
    ]
    rendered = "<|system|>Be brief.<|end|><|user|>What does the licence permit?<|end|><|assistant|>"
    async with serve(tokenizer=str(tokenizer_dir), shape=SMALL_WIDE) as (client, _):
        text = await complete(client, prompt)
        chat = await client.post(
            "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2}
        )
        again = await complete(client, prompt)
    ids = reference.encode(prompt).ids  # add_special_tokens=True: <s> first
    assert ids[0] == reference.token_to_id("<s>") and max(ids) > 255
    assert text["usage"]["prompt_tokens"] == len(ids) < len(prompt)
    chat_ids = reference.encode(rendered, add_special_tokens=False).ids
    assert chat.json()["usage"]["prompt_tokens"] == len(chat_ids)
    assert cached(again) == (len(ids) - 1) // 16 * 16  # block keys over the real token ids
    assert again["choices"] == text["choices"]


def test_the_cli_loads_the_tokenizer_and_refuses_a_bad_one(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    both = ["--role", "both", "--pages", "8", "--bytes-per-token", "64"]
    worker = build(parse_args([*both, "--tokenizer", str(tokenizer_dir)]))
    assert worker.tokenizer.prompt("hello world") != list(b"hello world")
    with pytest.raises(SystemExit, match="tokenizer"):
        build(parse_args([*both, "--tokenizer", str(tmp_path)]))
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    worker = build(parse_args([*both, "--kv-events-config", config]))
    assert worker.config.kv_events is not None and worker.config.kv_events.enabled
    with pytest.raises(SystemExit, match="kv-events-config"):
        build(parse_args([*both, "--kv-events-config", '{"hwm": "x"}']))
