"""Helpers of the tiered KV cache tests: a served ``--role both`` worker with tiers, prompts,
their block keys, ``/metrics`` samples and polling on the worker's tiers."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testkit.polling import await_until
from testkit.servers import arun_server
from transfer.events import BlockRemoved, BlockStored, KVEvent, KVEventSubscriber
from worker.app import SimWorker, WorkerConfig, create_app
from worker.block_hash import BlockKey, sglang_block_keys
from worker.hicache.config import TierConfig
from worker.hicache.controller import CacheController
from worker.kv import PoolShape

PAGE = 16
# 2 layers x 16 tokens x 64 bytes: 2 KiB pages; 40 pages of L1 (640 tokens)
SHAPE = PoolShape(layers=2, page_size=PAGE, bytes_per_token=64, pages=40)


def text(seed: int, length: int) -> str:
    """A deterministic prompt of ``length`` bytes (one token each)."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length))


def keys(prompt: str) -> list[BlockKey]:
    """The SGLang block keys of ``prompt``'s full pages."""
    return sglang_block_keys(list(prompt.encode()), PAGE)


def digests(prompt: str, pages: int | None = None) -> list[bytes]:
    return [key.digest for key in keys(prompt)[:pages]]


@dataclass
class Served:
    client: httpx.AsyncClient
    worker: SimWorker

    @property
    def tiers(self) -> CacheController:
        tiers = self.worker.ranks[0].tiers
        assert tiers is not None
        return tiers

    async def complete(self, prompt: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, **extra}
        response = await self.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    async def timed(self, prompt: str) -> tuple[dict[str, Any], float]:
        started = time.monotonic()
        answer = await self.complete(prompt)  # no decode time: as long as the first token
        return answer, time.monotonic() - started

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        body = (await self.client.get("/metrics")).text
        return sum(
            s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()
        )

    async def hits(self, tier: str) -> float:
        return await self.metric("pd_worker_hicache_hit_tokens_total", tier=tier)

    async def until(self, predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        await await_until(predicate, timeout, what)

    async def scanned(self) -> None:
        storage = self.tiers.storage
        assert storage is not None
        await await_until(storage.scanned.is_set, 10.0, "the L3 scan")

    async def settled(self) -> None:
        """Wait until no backup is due or in flight (L1 -> L2 -> L3) and the host link idles."""
        tiers = self.tiers

        def quiet() -> bool:
            storage = tiers.storage
            idle = storage is None or (storage.link.idle and storage.idle)
            return not tiers.backlog and tiers.link.idle and idle

        await await_until(quiet, 10.0, "backups to land")


def cached(answer: dict[str, Any]) -> int:
    value: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


def output(answer: dict[str, Any]) -> str:
    value: str = answer["choices"][0]["text"]
    return value


@contextlib.asynccontextmanager
async def serve(
    tiers: TierConfig | None = None,
    *,
    shape: PoolShape = SHAPE,
    role: Literal["prefill", "decode", "both"] = "both",
    **config: Any,
) -> AsyncIterator[Served]:
    """A worker (``--role both``; a decode serves local requests only) with ``tiers``
    (default: L2 of 64 pages), served on this loop."""
    worker_config = WorkerConfig(
        role, shape=shape, tiers=tiers or TierConfig(host_pages=64), **config
    )
    worker = SimWorker(worker_config, None)
    async with (
        arun_server(create_app(worker)) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client,
    ):
        yield Served(client, worker)


def storage_tiers(directory: Path, **options: Any) -> TierConfig:
    """L2 of 24 pages and a file L3 in ``directory``."""
    return TierConfig(
        **{
            "host_pages": 24,
            "storage_backend": "file",
            "storage_dir": str(directory),
            **options,
        }
    )


# --- KV events -------------------------------------------------------------------------------


def chain(events: list[KVEvent], medium: str) -> dict[int, tuple[int | None, list[int]]]:
    """Each stored block of ``medium``: its parent and its tokens."""
    blocks: dict[int, tuple[int | None, list[int]]] = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                blocks[block] = (parent, event.token_ids[i * PAGE : (i + 1) * PAGE])
                parent = block
    return blocks


def removed(events: list[KVEvent], medium: str) -> set[int]:
    return {
        block
        for event in events
        if isinstance(event, BlockRemoved) and event.medium == medium
        for block in event.block_hashes
    }


async def events_until(
    sub: KVEventSubscriber, events: list[KVEvent], done: Callable[[], bool], what: str
) -> None:
    for _ in range(200):  # 200 x 50 ms at most
        if done():
            return
        with contextlib.suppress(TimeoutError):
            events += (await sub.next(timeout=0.05)).batch.events
    raise AssertionError(f"no {what} in {events}")
