"""The tiered KV cache (``worker.hicache.controller``) in a served worker: L2/L3 round trips keep
the output, write policies and the eviction cascade, events per medium, metrics, a corrupt L2
page, layer-by-layer loading, and the prefill -> decode paths.

Each test serves its own worker(s); ``tiers_support`` has the helpers. A prompt ``A`` of 20 full
pages is evicted from the 40-page L1 by a filler of 40 pages, then asked for again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.polling import wait_until
from tests.worker.cache_cluster import cache_cluster, events_config
from tests.worker.tiers_support import (
    PAGE,
    SHAPE,
    Served,
    cached,
    chain,
    digests,
    events_until,
    keys,
    output,
    removed,
    serve,
    storage_tiers,
    text,
)
from transfer.events import KVEvent, KVEventSubscriber
from worker.hicache.config import TierConfig
from worker.kv import PoolShape

A = text(1, 20 * PAGE + 7)  # 20 full pages, all reusable
FILLERS = [text(100 + i, 40 * PAGE - 1) for i in range(3)]  # 40 pages each: empties L1
PREFIX_TOKENS = 20 * PAGE


async def _evict_from_l1(served: Served, filler: int = 0) -> None:
    await served.complete(FILLERS[filler])
    assert served.worker.pool.cache.match(keys(A)) == 0


# --- round trips ----------------------------------------------------------------------------


async def test_an_l2_round_trip_serves_the_prefix_with_the_same_output() -> None:
    async with serve(TierConfig(host_pages=64)) as served:
        first = await served.complete(A)
        await _evict_from_l1(served)
        assert all(d in served.tiers.host for d in digests(A))
        again = await served.complete(A)
        assert cached(first) == 0 and cached(again) == PREFIX_TOKENS
        assert output(again) == output(first)  # the first answer computed everything
        assert await served.hits("CPU_PINNED") == PREFIX_TOKENS
        assert await served.metric("pd_worker_hicache_load_pages_total") == 20
        assert await served.metric("pd_worker_hicache_load_seconds_count") == 1
        # the loaded pages are L1 pages again
        assert served.worker.pool.cache.match(keys(A)) == 20


async def test_an_l3_round_trip_serves_the_prefix_with_the_same_output(tmp_path: Path) -> None:
    tiers = storage_tiers(tmp_path, prefetch_policy="wait_complete")
    async with serve(tiers) as served:
        first = await served.complete(A)
        await served.settled()
        await _evict_from_l1(served)  # 39 filler pages through a 24-page L2 push A out of it
        await served.settled()
        assert not any(d in served.tiers.host for d in digests(A))
        assert all((tmp_path / d.hex()).is_file() for d in digests(A))
        again = await served.complete(A)
        assert cached(again) == PREFIX_TOKENS
        assert output(again) == output(first)
        assert await served.hits("DISK") == PREFIX_TOKENS
        assert await served.metric("pd_worker_hicache_prefetch_pages_total") == 20
        assert await served.metric("pd_worker_hicache_prefetch_bytes_total") == 20 * 2048


async def test_a_vllm_decode_computing_locally_uses_the_tiers_too() -> None:
    # kv_transfer_params without the remote prefill's fields: vLLM prefills locally
    local: dict[str, Any] = {"kv_transfer_params": {"do_remote_prefill": False}}
    tiers = TierConfig(host_pages=64)
    async with serve(tiers, role="decode", protocol="vllm-mooncake", hash_seed="1") as served:
        first = await served.complete(A, **local)
        await served.complete(FILLERS[0], **local)
        again = await served.complete(A, **local)
        assert cached(again) == PREFIX_TOKENS and output(again) == output(first)
        assert await served.hits("CPU_PINNED") == PREFIX_TOKENS


# --- write policies and the eviction cascade ------------------------------------------------


async def test_write_through_copies_a_committed_page_to_l2_and_l3_at_once(tmp_path: Path) -> None:
    async with serve(storage_tiers(tmp_path)) as served:
        await served.complete(A)
        await served.settled()
        storage = served.tiers.storage
        assert storage is not None
        assert served.worker.pool.cache.match(keys(A)) == 20  # still in L1 too
        assert all(d in served.tiers.host and d in storage for d in digests(A))
        assert all((tmp_path / d.hex()).is_file() for d in digests(A))


async def test_write_through_selective_copies_after_n_hits(tmp_path: Path) -> None:
    tiers = storage_tiers(tmp_path, write_policy="write_through_selective", selective_hits=3)
    async with serve(tiers) as served:
        for _ in range(2):  # the commit and one hit
            await served.complete(A)
            assert served.tiers.backlog == 0  # nothing due: no copy will come
            assert not any(d in served.tiers.host for d in digests(A))
        await served.complete(A)  # the third hit
        await served.settled()
        storage = served.tiers.storage
        assert storage is not None
        assert all(d in served.tiers.host and d in storage for d in digests(A))


async def test_write_back_cascades_l1_to_l2_to_l3_least_recently_used_first(
    tmp_path: Path,
) -> None:
    async with serve(storage_tiers(tmp_path, write_policy="write_back")) as served:
        host, storage = served.tiers.host, served.tiers.storage
        assert storage is not None
        await served.complete(A)
        assert served.tiers.backlog == 0 and len(host) == 0  # nothing until L1 evicts
        await _evict_from_l1(served)  # A's pages go to L2 as L1 evicts them
        assert all(d in host for d in digests(A))
        await served.settled()
        assert len(storage) == 0  # L2 evicted nothing yet: nothing went to L3
        await served.complete(FILLERS[1])  # the first filler's 39 pages enter the 24-page L2
        await served.settled()
        filler = digests(FILLERS[0])
        # L1 evicted the filler tail first, so L2 took its pages tail first; L2 then evicted
        # its least recently used: all of A, then the filler's tail
        assert {h.digest for h in host.headers()} == set(filler[:24])
        assert set(storage.index) == set(digests(A)) | set(filler[24:])
        assert all((tmp_path / d.hex()).is_file() for d in digests(A))


# --- integrity --------------------------------------------------------------------------------


async def test_a_corrupt_l2_page_is_dropped_and_its_prefix_recomputed() -> None:
    async with serve(TierConfig(host_pages=64)) as served:
        first = await served.complete(A)
        await _evict_from_l1(served)
        host = served.tiers.host
        page = host.get(digests(A)[1])
        assert page is not None
        host.data[page.slot * host.page_bytes + 100] ^= 0xFF
        again = await served.complete(A)
        assert cached(again) == PAGE  # page 0 only: from page 1 on it was computed
        assert output(again) == output(first)
        assert await served.metric("pd_worker_hicache_corrupt_pages_total", tier="CPU_PINNED") == 1
        # dropped; the recomputed page was backed up again (write-through), and checks out
        await served.settled()
        fresh = host.get(digests(A)[1])
        assert fresh is not None and fresh is not page
        host.verify(fresh)


# --- events and metrics ---------------------------------------------------------------------


async def test_tier_events_carry_their_medium_and_chain_like_the_gpu_ones(tmp_path: Path) -> None:
    async with serve(storage_tiers(tmp_path), kv_events=events_config()) as served:
        [(live, replay)] = served.worker.event_endpoints
        ids = [k.event_id for k in keys(A)]
        async with KVEventSubscriber(live, replay_endpoint=replay, start_seq=0) as sub:
            await served.complete(A)
            await served.settled()
            events: list[KVEvent] = []
            await events_until(sub, events, lambda: len(chain(events, "DISK")) == 20, "DISK blocks")
            gpu = chain(events, "GPU")
            assert set(gpu) == set(ids) and gpu[ids[0]][0] is None
            assert chain(events, "CPU_PINNED") == gpu == chain(events, "DISK")
            await _evict_from_l1(served)
            await events_until(
                sub, events, lambda: set(ids) <= removed(events, "CPU_PINNED"), "L2 removals"
            )
            assert set(ids) <= removed(events, "GPU")
            assert not removed(events, "DISK")
        await served.settled()
        backups = {
            tier: await served.metric("pd_worker_hicache_backup_pages_total", tier=tier)
            for tier in ("CPU_PINNED", "DISK")
        }
        assert backups == {"CPU_PINNED": 20 + 39, "DISK": 20 + 39}
        backed_bytes = await served.metric("pd_worker_hicache_backup_bytes_total", tier="DISK")
        assert backed_bytes == 59 * 2048
        assert await served.metric("pd_worker_hicache_backup_seconds_count", tier="DISK") >= 1
        assert await served.metric("pd_worker_hicache_pages", tier="CPU_PINNED") == 24
        assert await served.metric("pd_worker_hicache_pages", tier="DISK") == 59
        health = (await served.client.get("/health")).json()
        assert health["hicache"] == [
            {
                "host_pages": 24,
                "host_capacity": 24,
                "storage_pages": 59,
                "storage_scanned": True,
            }
        ]


async def test_hits_and_misses_are_counted_per_tier() -> None:
    async with serve(TierConfig(host_pages=64)) as served:
        await served.complete(A)
        await served.complete(A)  # an L1 hit of 20 pages
        await _evict_from_l1(served)
        await served.complete(A)  # an L2 hit of 20 pages
        samples = {
            (kind, tier): await served.metric(f"pd_worker_hicache_{kind}_tokens_total", tier=tier)
            for kind in ("hit", "miss")
            for tier in ("GPU", "CPU_PINNED", "DISK")
        }
    total = 3 * len(A) + len(FILLERS[0])
    assert samples[("hit", "GPU")] == PREFIX_TOKENS
    assert samples[("miss", "GPU")] == total - PREFIX_TOKENS
    assert samples[("hit", "CPU_PINNED")] == PREFIX_TOKENS
    assert samples[("miss", "CPU_PINNED")] == total - 2 * PREFIX_TOKENS
    assert samples[("hit", "DISK")] == samples[("miss", "DISK")] == 0  # no L3


async def test_without_tiers_there_are_no_tier_metrics_nor_health_entries() -> None:
    async with serve(TierConfig()) as served:
        await served.complete(A)
        body = (await served.client.get("/metrics")).text
        health = (await served.client.get("/health")).json()
    assert "pd_worker_hicache" not in body and "hicache" not in health
    assert served.worker.ranks[0].tiers is None


# --- layer-by-layer loading -------------------------------------------------------------------

LAYERED = PoolShape(layers=8, page_size=PAGE, bytes_per_token=256, pages=34)  # 32 KiB pages
COMPUTE_S_PER_TOKEN = 1.2e-3  # 256 tokens: 0.31 s
# 16 pages of 32 KiB in 0.3 s: the load of the prefix takes as long as computing the tail
HOST_BANDWIDTH = 16 * 32768 / 0.3


async def _ttft_from_l2(layerwise: bool) -> tuple[int, float]:
    prefix = text(7, 16 * PAGE)
    tiers = TierConfig(host_pages=128, host_bandwidth=HOST_BANDWIDTH, layerwise=layerwise)
    async with serve(tiers, shape=LAYERED, compute_s_per_token=COMPUTE_S_PER_TOKEN) as served:
        await served.complete(prefix + text(8, 16 * PAGE))
        await served.complete(text(9, 34 * PAGE - 1))  # evicts every L1 page
        await served.settled()  # backups no longer hold the host link
        answer, seconds = await served.timed(prefix + text(10, 16 * PAGE))
    return cached(answer), seconds


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
async def test_layerwise_loading_overlaps_the_load_with_the_forward_pass() -> None:
    cached_on, layerwise = await _ttft_from_l2(True)
    cached_off, whole = await _ttft_from_l2(False)
    assert cached_on == cached_off == 16 * PAGE
    # off: load (0.3 s) then compute (0.31 s); on: layer i computes once layer i is in, so
    # about max(load, compute) + one layer's compute (0.34 s)
    assert whole >= 0.55
    assert whole - layerwise > 0.15, (layerwise, whole)


# --- prefill -> decode ----------------------------------------------------------------------


def _post(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 8}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _prefill_metric(url: str, name: str, tier: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name and s.labels.get("tier") == tier
    )


@pytest.mark.parametrize("engine", ["sglang", "vllm-mooncake"])
@pytest.mark.parametrize("tier", ["CPU_PINNED", "DISK"])
def test_prefill_serves_its_prefix_from_a_lower_tier_to_the_decode(
    engine: str, tier: str, tmp_path: Path
) -> None:
    tiers = (
        TierConfig(host_pages=64)
        if tier == "CPU_PINNED"
        else storage_tiers(tmp_path, prefetch_policy="wait_complete")
    )
    with cache_cluster(engine, prefill={"shape": SHAPE, "tiers": tiers}) as cluster:
        controller = cluster.prefill.ranks[0].tiers
        assert controller is not None

        def settled() -> bool:
            storage = controller.storage
            return not controller.backlog and (storage is None or storage.idle)

        def quiet() -> bool:
            return settled() and cluster.idle()

        first = _post(cluster.router, A)
        wait_until(quiet, 10.0, "backups, rooms and pages")
        _post(cluster.router, FILLERS[0])
        wait_until(quiet, 10.0, "backups, rooms and pages")
        again = _post(cluster.router, A)
        reference = _post(cluster.reference, A)
        assert output(again) == output(reference) == output(first)
        if engine == "sglang":
            assert cached(again) == PREFIX_TOKENS  # the prefill's hit, L2/L3 included
        hits = _prefill_metric(cluster.prefill_url, "pd_worker_hicache_hit_tokens_total", tier)
        assert hits == PREFIX_TOKENS
        wait_until(cluster.idle, 5.0, "rooms closed and pages unreferenced")


async def test_l3_evicts_beyond_its_capacity_and_announces_it(tmp_path: Path) -> None:
    tiers = storage_tiers(tmp_path, storage_pages=25)
    async with serve(tiers, kv_events=events_config()) as served:
        [(live, replay)] = served.worker.event_endpoints
        ids = {k.event_id for k in keys(A)}
        async with KVEventSubscriber(live, replay_endpoint=replay, start_seq=0) as sub:
            await served.complete(A)
            await served.settled()
            await served.complete(FILLERS[0])  # 39 more pages through L2 into L3
            await served.settled()
            events: list[KVEvent] = []
            await events_until(sub, events, lambda: ids <= removed(events, "DISK"), "L3 evictions")
        storage = served.tiers.storage
        assert storage is not None and len(storage) == 25
        assert set(storage.index) == set(digests(FILLERS[0])[14:])  # the oldest went first
        assert len(await asyncio.to_thread(lambda: list(tmp_path.iterdir()))) == 25
        assert await served.metric("pd_worker_hicache_pages", tier="DISK") == 25
