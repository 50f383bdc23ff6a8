"""The storage tier (L3) of the tiered KV cache: a restarted worker serves and announces what its
directory holds, prefetch (threshold, rate limit, late policies), a corrupt page file, the
``--hicache-*`` flags, and per-worker directories through ``pd-cluster``.

A module fixture runs a worker once to store two prompts in a directory (``A``: 20 full pages,
above the default 256-token prefetch threshold; ``S``: 10 pages, below it); each test restarts a
worker on its own copy, whose L1 and L2 are empty: everything comes from L3.
"""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.cluster_process import ClusterProcess
from testkit.polling import wait_until
from tests.worker.cache_cluster import cache_cluster, events_config
from tests.worker.tiers_support import (
    PAGE,
    SHAPE,
    cached,
    chain,
    digests,
    events_until,
    keys,
    output,
    serve,
    storage_tiers,
    text,
)
from transfer.events import KVEvent, KVEventSubscriber
from worker.__main__ import build, build_parser, parse_args
from worker.cluster import _decode_args, _Layout, _parse, _prefill_args
from worker.hicache.config import TierConfig, open_rank_store
from worker.hicache.stores.directory import DirectoryPageStore

A = text(1, 20 * PAGE + 7)
S = text(2, 10 * PAGE + 7)
PAGE_BYTES = 2048  # SHAPE: 2 layers x 16 tokens x 64 bytes
SLOW_STORAGE = PAGE_BYTES / 0.04  # bytes/s: 40 ms per page read


@dataclass(frozen=True)
class Stored:
    directory: Path
    outputs: dict[str, str]  # what a worker computing everything answered


async def _store(directory: Path) -> dict[str, str]:
    async with serve(storage_tiers(directory)) as served:
        outputs = {prompt: output(await served.complete(prompt)) for prompt in (A, S)}
        await served.settled()
    return outputs


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Stored:
    directory = tmp_path_factory.mktemp("stored")
    outputs = asyncio.run(_store(directory))
    assert len(list(directory.iterdir())) == 30
    return Stored(directory, outputs)


@pytest.fixture
def l3(stored: Stored, tmp_path: Path) -> Path:
    """This test's copy of the stored directory (mtimes kept: the store's LRU order)."""
    copy = tmp_path / "l3"
    shutil.copytree(stored.directory, copy)
    return copy


# --- restart ----------------------------------------------------------------------------------


async def test_a_restarted_worker_announces_and_serves_its_stored_pages(
    l3: Path, stored: Stored
) -> None:
    tiers = storage_tiers(l3, prefetch_policy="wait_complete")
    async with serve(tiers, kv_events=events_config()) as served:
        [(live, replay)] = served.worker.event_endpoints
        ids = {k.event_id for k in keys(A)} | {k.event_id for k in keys(S)}
        async with KVEventSubscriber(live, replay_endpoint=replay, start_seq=0) as sub:
            await served.scanned()
            await sub.catch_up()  # what was announced before this subscriber joined
            events: list[KVEvent] = []
            await events_until(sub, events, lambda: ids <= set(chain(events, "DISK")), "DISK")
        disk = chain(events, "DISK")
        a_keys = keys(A)
        assert disk[a_keys[0].event_id] == (None, list(A[:PAGE].encode()))
        assert disk[a_keys[5].event_id] == (a_keys[4].event_id, list(A[80:96].encode()))
        assert not chain(events, "GPU") and not chain(events, "CPU_PINNED")
        answer = await served.complete(A)
        assert cached(answer) == 20 * PAGE
        assert output(answer) == stored.outputs[A]
        assert await served.hits("DISK") == 20 * PAGE
        assert await served.metric("pd_worker_hicache_pages", tier="DISK") == 30


# --- prefetch -------------------------------------------------------------------------------


@pytest.mark.parametrize(("threshold", "s_cached"), [(256, 0), (160, 10 * PAGE)])
async def test_only_an_l3_run_of_at_least_the_threshold_is_prefetched(
    l3: Path, stored: Stored, threshold: int, s_cached: int
) -> None:
    tiers = storage_tiers(l3, prefetch_policy="wait_complete", prefetch_threshold_tokens=threshold)
    async with serve(tiers) as served:
        await served.scanned()
        short = await served.complete(S)  # 160 tokens in L3
        assert cached(short) == s_cached
        assert output(short) == stored.outputs[S]
        prefetched = await served.metric("pd_worker_hicache_prefetch_pages_total")
        assert prefetched == s_cached // PAGE
        long = await served.complete(A)  # 320 tokens in L3
        assert cached(long) == 20 * PAGE and output(long) == stored.outputs[A]


async def test_the_prefetch_rate_limit_paces_the_reads(l3: Path, stored: Stored) -> None:
    rate = 19 * PAGE_BYTES / 0.5  # 20 pages: the first at once, 19 more over 0.5 s
    tiers = storage_tiers(l3, prefetch_policy="wait_complete", prefetch_rate=rate)
    async with serve(tiers) as served:
        await served.scanned()
        answer, seconds = await served.timed(A)
        assert cached(answer) == 20 * PAGE and output(answer) == stored.outputs[A]
        assert seconds >= 0.45
        prefetch_s = await served.metric("pd_worker_hicache_prefetch_seconds_sum")
        assert 0.45 <= prefetch_s < 5.0


async def test_wait_complete_waits_for_the_whole_prefetch(l3: Path, stored: Stored) -> None:
    tiers = storage_tiers(l3, prefetch_policy="wait_complete", storage_bandwidth=SLOW_STORAGE)
    async with serve(tiers) as served:
        await served.scanned()
        answer, seconds = await served.timed(A)
    assert cached(answer) == 20 * PAGE and output(answer) == stored.outputs[A]
    assert seconds >= 20 * 0.04 * 0.9


async def test_the_timeout_policy_waits_then_computes_the_rest(l3: Path, stored: Stored) -> None:
    tiers = storage_tiers(
        l3, prefetch_policy="timeout", prefetch_timeout_s=0.25, storage_bandwidth=SLOW_STORAGE
    )
    async with serve(tiers) as served:
        await served.scanned()
        answer, seconds = await served.timed(A)
        hits = await served.hits("DISK")
    # about 6 of the 20 pages (40 ms each) had arrived after 0.25 s
    assert 0 < cached(answer) < 20 * PAGE and cached(answer) % PAGE == 0
    assert hits == cached(answer)
    assert output(answer) == stored.outputs[A]
    assert 0.25 <= seconds < 20 * 0.04


async def test_best_effort_does_not_wait_for_the_prefetch(l3: Path, stored: Stored) -> None:
    tiers = storage_tiers(l3, storage_bandwidth=SLOW_STORAGE)  # best_effort: the default
    async with serve(tiers) as served:
        await served.scanned()
        answer, seconds = await served.timed(A)
    # a co-located request reaches its forward pass at once: nothing had arrived
    assert cached(answer) == 0 and output(answer) == stored.outputs[A]
    assert seconds < 20 * 0.04 / 2


def _post(url: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_best_effort_uses_what_arrived_while_the_request_queued(l3: Path, stored: Stored) -> None:
    tiers = storage_tiers(l3, storage_bandwidth=PAGE_BYTES / 0.06)  # 60 ms per page
    prefill = {"shape": SHAPE, "tiers": tiers, "compute_s_per_token": 2e-3}
    with cache_cluster("sglang", prefill=prefill) as cluster:
        controller = cluster.prefill.ranks[0].tiers
        assert controller is not None and controller.storage is not None
        wait_until(controller.storage.scanned.is_set, 10.0, "the L3 scan")
        with ThreadPoolExecutor(2) as pool:
            # 0.5 s of forward pass first (16 of the 40 pages): A waits for it while its
            # prefetch runs
            busy = pool.submit(_post, cluster.router, text(60, 250))
            wait_until(lambda: cluster.prefill.queues.get("forward", 0) == 1, 5.0, "busy")
            answer = pool.submit(_post, cluster.router, A).result()
            busy.result()
    assert 0 < cached(answer) < 20 * PAGE  # about 8 pages of 20 had arrived
    assert output(answer) == stored.outputs[A]


# --- integrity --------------------------------------------------------------------------------


async def test_a_corrupt_page_file_is_detected_and_its_prefix_recomputed(
    l3: Path, stored: Stored
) -> None:
    async with serve(storage_tiers(l3, prefetch_policy="wait_complete")) as served:
        await served.scanned()
        target = l3 / digests(A)[2].hex()
        blob = bytearray(target.read_bytes())
        blob[-1] ^= 0x01  # one bit of the page's KV data
        target.write_bytes(bytes(blob))
        answer = await served.complete(A)
        assert cached(answer) == 2 * PAGE  # pages 0 and 1; from page 2 on: computed
        assert output(answer) == stored.outputs[A]
        assert await served.metric("pd_worker_hicache_corrupt_pages_total", tier="DISK") == 1
        assert await served.hits("DISK") == 2 * PAGE
        await served.settled()  # the recomputed page was stored again (write-through)
    store = DirectoryPageStore(l3)
    page = await store.get(digests(A)[2])
    await store.aclose()
    assert page is not None and page.header.position == 2


# --- flags and pd-cluster ---------------------------------------------------------------------

_SMALL = ["--role", "both", "--pages", "8", "--bytes-per-token", "64"]


def test_the_hicache_flags_build_the_tier_config(tmp_path: Path) -> None:
    assert build(parse_args(_SMALL)).config.tiers == TierConfig()
    assert build(parse_args(_SMALL)).ranks[0].tiers is None
    flags = [
        "--hicache-host-pages", "16", "--hicache-write-policy", "write_through_selective",
        "--hicache-selective-hits", "3", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(tmp_path), "--hicache-storage-pages", "100",
        "--hicache-prefetch-policy", "timeout", "--hicache-prefetch-threshold", "64",
        "--hicache-prefetch-timeout", "0.5", "--hicache-prefetch-rate", "1e9",
        "--hicache-host-bandwidth", "1e10", "--hicache-storage-bandwidth", "2e9",
        "--no-hicache-layerwise", "--hicache-storage-fsync", "page",
    ]  # fmt: skip
    worker = build(parse_args([*_SMALL, *flags]))
    assert worker.config.tiers == TierConfig(
        host_pages=16,
        write_policy="write_through_selective",
        selective_hits=3,
        storage_backend="file",
        storage_dir=str(tmp_path),
        storage_pages=100,
        storage_fsync="page",
        prefetch_policy="timeout",
        prefetch_threshold_tokens=64,
        prefetch_timeout_s=0.5,
        prefetch_rate=1e9,
        host_bandwidth=1e10,
        storage_bandwidth=2e9,
        layerwise=False,
    )
    assert worker.ranks[0].tiers is not None
    with pytest.raises(SystemExit, match="storage-dir"):
        build(
            parse_args([*_SMALL, "--hicache-host-pages", "4", "--hicache-storage-backend", "file"])
        )
    with pytest.raises(SystemExit, match="host pages"):
        build(
            parse_args([*_SMALL, "--hicache-storage-backend", "file", "--hicache-storage-dir", "x"])
        )


def test_each_dp_rank_gets_its_own_directory(tmp_path: Path) -> None:
    config = storage_tiers(tmp_path)
    for rank, dp, expected in [(0, 1, tmp_path), (1, 2, tmp_path / "rank1")]:
        store = open_rank_store(config, rank, dp, "m/", lambda _: None)
        assert isinstance(store, DirectoryPageStore) and store.root == expected


def test_pd_cluster_gives_each_worker_a_stable_directory(tmp_path: Path) -> None:
    tail = ["--hicache-host-pages", "8", "--hicache-storage-backend", "file"]
    runs = [
        ["--prefill", "2", "--", *tail, "--hicache-storage-dir", str(tmp_path)],
        ["--prefill", "2", "--", *tail, f"--hicache-storage-dir={tmp_path}"],
        ["--prefill", "2", "--hicache-storage-dir", str(tmp_path), "--", *tail],
    ]
    for argv in runs:  # every spelling, every start: the same directories
        args = _parse(argv)
        layout = _Layout(args)
        prefill = _prefill_args(args, layout.prefills[1], layout.namespaces[1], None, 1)
        decode = _decode_args(args, layout.decodes[0], 0)
        dirs = [parse_args(cmd[1:]).hicache_storage_dir for cmd in (prefill, decode)]
        assert dirs == [str(tmp_path / "prefill-1"), str(tmp_path / "decode-0")]
        assert parse_args(prefill[1:]).hicache_host_pages == 8
    with pytest.raises(SystemExit):
        _parse(["--hicache-storage-dir", "a", "--", "--hicache-storage-dir", "b"])


def _scanned(url: str) -> bool:
    tiers = httpx.get(f"{url}/health", timeout=5).json()["hicache"]
    return all(rank["storage_scanned"] for rank in tiers)


def _ask_cluster(log: Path, argv: list[str], stored: Path) -> dict[str, Any]:
    """Start pd-cluster, ask for ``A`` once its prefill has scanned L3, wait until ``A``'s
    pages are stored, stop it."""
    cluster = ClusterProcess(log, *argv)
    try:
        cluster.wait_ready()
        prefill = httpx.get(f"{cluster.url}/ready", timeout=5).json()["prefill"][0]["url"]
        wait_until(lambda: _scanned(prefill), 10.0, "the prefill's L3 scan", interval=0.1)
        answer = _post(cluster.url, A)
        wait_until(lambda: len(list(stored.glob("*"))) >= 20, 10.0, "A's pages stored")
        return answer
    finally:
        cluster.stop()


@pytest.mark.slow  # ~15 s: scripts/test-slow (CI runs it)
@pytest.mark.timeout(120)  # two cluster starts
def test_a_restarted_pd_cluster_serves_from_its_workers_directories(tmp_path: Path) -> None:
    storage = tmp_path / "l3"
    argv = [
        "--hicache-storage-dir", str(storage), "--ready-timeout", "30", "--",
        "--pages", "40", "--bytes-per-token", "64", "--layers", "2",
        "--hicache-host-pages", "24", "--hicache-storage-backend", "file",
        "--hicache-prefetch-policy", "wait_complete",
    ]  # fmt: skip
    first, again = (
        _ask_cluster(tmp_path / f"cluster{start}.log", argv, storage / "prefill-0")
        for start in range(2)
    )
    assert cached(first) == 0 and cached(again) == 20 * PAGE  # the second start: from L3
    assert output(again) == output(first)
    assert (storage / "decode-0").is_dir()


def test_the_docs_list_every_hicache_flag() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "simulated-engine.md").read_text()
    section = readme.split("### Tiered KV cache (HiCache) in pd-worker", 1)[1].split("\n## ", 1)[0]
    rows = "\n".join(line for line in section.splitlines() if line.startswith("| `--hicache"))
    flags = [
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith(("--hicache-", "--no-hicache-"))
    ]
    assert len(flags) == 17
    assert [flag for flag in flags if f"`{flag}" not in rows] == []
