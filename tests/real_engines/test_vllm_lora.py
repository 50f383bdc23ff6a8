"""LoRA adapters on a real vLLM 0.32 (CPU) engine, as the router reads them.

One engine with the tiny model, a random LoRA adapter (``model.py --lora``) loaded as
``sql-lora``, prefix caching and its KV events. The engine is the witness of what
``docs/concepts/protocols.md`` section 11.2 says from its sources:

* its ``/v1/models`` lists the adapter with ``parent`` set to the base model, and the router's
  health prober learns the adapter from it (a worker's ``adapters``);
* its ``BlockStored`` events name the adapter (``lora_name``) and it keys the adapter's blocks
  apart: the base model's request for a prompt the adapter cached finds nothing cached;
* the router's KV index, fed by the router's own event feed, finds the adapter's blocks by the
  adapter's keys (``adapter_root``) only, and the base model's by the base keys only.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import cast

import httpx
import msgspec
import pytest

from router.fleet.health import HealthProber
from router.kv_cache.event_feed import KVEventFeed
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.keys import adapter_root, chain_keys
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.scheduling.tokenizers import LocalTokenizer
from router.schemas import Endpoint, parse_request
from router.settings import CacheAwareSettings, EngineProtocol, HealthSettings
from router.upstream.base import UpstreamClient, UpstreamPool
from router.workers import Role as WorkerRole
from router.workers import Worker
from testkit.polling import await_until
from tests.real_engines.conftest import MODEL_BUILD_TIMEOUT_S, model_builder_python
from tests.real_engines.openai_client import SERVED_MODEL
from tests.real_engines.vllm_engines import Engine, Role, launch, start_engines, stop

pytestmark = pytest.mark.real_engine

ADAPTER = "sql-lora"
BLOCK_SIZE = 32  # the smallest the CPU attention backend takes
PROMPT = "The river carried the old boat past the mill and the bridge at dawn. " * 6


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    adapter = tmp_path_factory.mktemp("lora") / ADAPTER
    builder = [str(model_builder_python()), str(Path(__file__).with_name("model.py"))]
    built = subprocess.run(
        [*builder, "--lora", str(adapter), str(tiny_model)],
        timeout=MODEL_BUILD_TIMEOUT_S,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    extra = [
        *("--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--enable-lora"),
        *("--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}"),
    ]
    log_dir = tmp_path_factory.mktemp("vllm-lora-logs")
    started: list[Engine] = []
    try:
        start_engines(
            [
                lambda: launch(
                    tiny_model, Role.COLOCATED, "lora", log_dir, extra=extra, kv_events=True
                )
            ],
            started,
        )
        yield started[0]
    finally:
        for each in started:
            stop(each)


def _complete(engine: Engine, model: str) -> int:
    """The prompt's cached tokens as the engine reports them for one completion of ``model``."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    answer = httpx.post(engine.url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


@contextlib.asynccontextmanager
async def _feed(worker: Worker) -> AsyncIterator[KVBlockIndex]:
    """The router's KV event feed following ``worker``'s events into an index of its own."""
    index = KVBlockIndex(100_000)
    feed = KVEventFeed(
        lambda: [worker], index, ApproxPrefixTree(1 << 20), CacheAwareSettings(), poll_s=0.05
    )
    task = asyncio.create_task(feed.run())
    try:
        yield index
    finally:
        await feed.aclose()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.timeout(120, func_only=True)  # the engine's start is the fixture's own
async def test_the_router_learns_the_adapter_and_keys_its_blocks_apart(
    engine: Engine, tiny_model: Path
) -> None:
    pool: UpstreamPool = UpstreamPool(needs_engine_ids=False)
    decode = Worker(WorkerRole.DECODE, engine.url)
    pool.add(decode, cast(UpstreamClient, None))  # probes only: no leg is sent
    prober = HealthProber(pool, EngineProtocol.VLLM_MOONCAKE, HealthSettings(interval_s=0.2))
    probing = asyncio.create_task(prober.run())
    try:
        await await_until(lambda: bool(decode.adapters), 30, "the adapter learned")
    finally:
        probing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probing
        await prober.aclose()
    assert decode.models == {SERVED_MODEL, ADAPTER} and decode.adapters == {ADAPTER}

    assert engine.kv_events is not None
    prefill = Worker(
        WorkerRole.PREFILL,
        engine.url,
        kv_events=engine.kv_events.endpoint,
        kv_events_replay=engine.kv_events.replay_endpoint,
    )
    prefill.healthy = True
    body = msgspec.json.encode({"model": SERVED_MODEL, "prompt": PROMPT})
    request = parse_request(Endpoint.COMPLETIONS, body)
    tokens = await LocalTokenizer.from_dir(tiny_model).tokens(request)
    assert tokens is not None
    blocks = len(tokens) // BLOCK_SIZE
    base_keys = chain_keys(tokens, BLOCK_SIZE)
    adapter_keys = chain_keys(tokens, BLOCK_SIZE, adapter_root(ADAPTER))
    location = (prefill.id, 0)
    async with _feed(prefill) as index:
        assert _complete(engine, ADAPTER) == 0
        await await_until(
            lambda: index.match(adapter_keys, BLOCK_SIZE).get(location) == blocks,
            30,
            "the adapter's blocks in the router's index",
        )
        assert index.match(base_keys, BLOCK_SIZE).get(location, 0) == 0
        # the engine keys them apart too: the base model finds none of the adapter's blocks
        assert _complete(engine, SERVED_MODEL) == 0
        await await_until(
            lambda: index.match(base_keys, BLOCK_SIZE).get(location) == blocks,
            30,
            "the base model's blocks in the router's index",
        )
        assert _complete(engine, ADAPTER) == blocks * BLOCK_SIZE  # each finds its own
