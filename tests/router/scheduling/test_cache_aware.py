"""``cache_aware``: a prompt goes where its prefix is cached, unless the load is imbalanced."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry.models import worker_id
from router import create_app
from router.adapters import VllmNixlAdapter
from router.kv_cache.index import KVBlockIndex, chain_keys
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.kv_tiers import Tier
from router.scheduling.features import RequestFeatures, request_text
from router.scheduling.policies import build_policies, build_policy
from router.scheduling.policies.cache_aware import CacheAware
from router.scheduling.tokenizers import LocalTokenizer
from router.schemas import Endpoint, parse_request
from router.settings import CacheAwareSettings, PolicySettings, WorkerSpec
from router.workers import Role, Worker
from testkit.fake_cluster import FakeClusterFactory, serve_engine, settings_for
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import run_server
from tests.router.scheduling.test_prompt_tokens import tiny_tokenizer_dir
from transfer.events import BlockStored, KVEventPublisher

MODEL = "fake-model"
TOKENS = list(range(100, 116))  # four blocks of four


def prefills(count: int, dp_size: int = 1) -> list[Worker]:
    workers = []
    for i in range(count):
        worker = Worker(Role.PREFILL, f"http://127.0.0.1:{9000 + i}", id=f"p{i}")
        worker.set_layout(dp_size)
        worker.healthy = True
        workers.append(worker)
    return workers


def policy(**settings: Any) -> CacheAware:
    cache = CacheAwareSettings(kv_events_port=5557, **settings)
    return CacheAware(cache, index=KVBlockIndex(10_000), tree=ApproxPrefixTree(1 << 20))


def store(
    chooser: CacheAware, location: tuple[str, int], blocks: int, tier: Tier = Tier.GPU
) -> None:
    hashes = list(range(1, blocks + 1))
    chooser.index.apply_stored(location, hashes, None, TOKENS[: blocks * 4], 4, tier)


def test_precise_the_longest_cached_prefix_wins() -> None:
    chooser = policy()
    a, b = prefills(2)
    store(chooser, ("p0", 0), 1)
    store(chooser, ("p1", 0), 3)
    choice = chooser.choose_prefill([a, b], RequestFeatures(text="x", tokens=TOKENS))
    assert (choice.worker, choice.rank, choice.how, choice.cached_tokens) == (b, 0, "precise", 12)


def test_ties_go_to_the_lower_load() -> None:
    chooser = policy()
    a, b = prefills(2)
    a.rank_inflight[0] = 3
    for _ in range(4):
        choice = chooser.choose_prefill([a, b], RequestFeatures(text="x", tokens=TOKENS))
        assert choice.worker is b and choice.cached_tokens == 0


def test_load_imbalance_overrides_the_cache() -> None:
    chooser = policy(balance_abs_threshold=32, balance_rel_threshold=1.5)
    a, b = prefills(2)
    store(chooser, ("p1", 0), 4)
    features = RequestFeatures(text="x", tokens=TOKENS)
    b.rank_inflight[0], a.rank_inflight[0] = 30, 0  # max - min = 30: not imbalanced
    assert chooser.choose_prefill([a, b], features).worker is b
    b.rank_inflight[0], a.rank_inflight[0] = 40, 0  # 40 > 32 and 40 > 1.5 * 0
    choice = chooser.choose_prefill([a, b], features)
    assert (choice.worker, choice.how, choice.cached_tokens) == (a, "load", 0)
    b.rank_inflight[0], a.rank_inflight[0] = 100, 70  # 30 apart: the cache wins again
    assert chooser.choose_prefill([a, b], features).worker is b


def test_a_busy_home_loses_the_request_once_its_queue_costs_more_than_the_whole_prompt() -> None:
    """The prefix holder wins while the prefill work this router queued there is cheaper than
    computing the whole prompt elsewhere; past that, an idle rank takes the request."""
    chooser = policy()
    home, idle = prefills(2)
    store(chooser, ("p0", 0), 3)  # 12 of the 16 prompt tokens cached at home: 4 to compute
    features = RequestFeatures(text="x", tokens=TOKENS)
    with home.load(0, tokens=11):  # 11 + 4 < 0 + 16
        choice = chooser.choose_prefill([home, idle], features)
        assert (choice.worker, choice.how, choice.cached_tokens) == (home, "precise", 12)
    with home.load(0, tokens=13):  # 13 + 4 > 16
        choice = chooser.choose_prefill([home, idle], features)
        assert (choice.worker, choice.how, choice.cached_tokens) == (idle, "load", 0)
    assert home.pending_tokens(0) == 0  # released with the legs
    assert chooser.choose_prefill([home, idle], features).worker is home


def test_a_prefix_on_the_gpu_beats_the_same_prefix_on_disk_which_beats_nothing() -> None:
    chooser = policy(tier_weights="DISK=0.5")
    on_disk, on_gpu = prefills(2)
    features = RequestFeatures(text="x", tokens=TOKENS)
    store(chooser, ("p0", 0), 4, Tier.DISK)
    choice = chooser.choose_prefill([on_disk, on_gpu], features)
    assert (choice.worker, choice.how, choice.cached_tokens) == (on_disk, "precise", 8)
    store(chooser, ("p1", 0), 4)
    for _ in range(3):  # equal load: no round-robin tie between them
        choice = chooser.choose_prefill([on_disk, on_gpu], features)
        assert (choice.worker, choice.how, choice.cached_tokens) == (on_gpu, "precise", 16)


def test_credited_tokens_weigh_against_queued_work_and_the_threshold() -> None:
    """A rank holding the prompt on the GPU costs its queue; one holding it on disk costs the
    uncredited share (16 - 0.25 * 16 = 12 tokens); too little credit does not count at all."""
    chooser = policy(tier_weights="DISK=0.25")
    home, spare = prefills(2)
    store(chooser, ("p0", 0), 4)
    store(chooser, ("p1", 0), 4, Tier.DISK)
    features = RequestFeatures(text="x", tokens=TOKENS)
    with home.load(0, tokens=11):  # 11 < 12
        assert chooser.choose_prefill([home, spare], features).worker is home
    with home.load(0, tokens=13):  # 13 > 12
        choice = chooser.choose_prefill([home, spare], features)
        assert (choice.worker, choice.how, choice.cached_tokens) == (spare, "precise", 4)
    thin = policy(tier_weights={"DISK": 0.25}, cache_threshold=0.3)
    store(thin, ("p1", 0), 4, Tier.DISK)  # 4 of 16 tokens credited: under the threshold
    assert thin.choose_prefill([home, spare], features).how == "load"


def test_scores_show_matched_blocks_per_tier_and_their_credit() -> None:
    chooser = policy(tier_weights="CPU_PINNED=0.75,DISK=0.5")
    a, b = prefills(2)
    store(chooser, ("p0", 0), 2)
    chooser.index.apply_stored(("p0", 0), [3, 4], 2, TOKENS[8:], 4, Tier.HOST)
    chooser.index.apply_stored(("p0", 0), [1, 2, 3, 4], None, TOKENS, 4, Tier.DISK)
    mode, rows = chooser.scores([a, b], RequestFeatures(text="x", tokens=TOKENS))
    assert mode == "precise"
    by_worker = {row["worker"]: row for row in rows}
    held, empty = by_worker[a.url], by_worker[b.url]
    assert held["cached_blocks_by_tier"] == {"GPU": 2, "CPU_PINNED": 2, "DISK": 0}
    assert held["credited_blocks"] == 3.5 and held["predicted_cached_tokens"] == 14
    assert held["cost_tokens"] == 16 - 14
    assert empty["cached_blocks_by_tier"] == {"GPU": 0, "CPU_PINNED": 0, "DISK": 0}
    assert empty["credited_blocks"] == 0 and empty["cost_tokens"] == 16


def test_without_cache_the_rank_with_the_least_queued_prefill_work_wins() -> None:
    """Two legs in flight at each rank, but one rank's are long prompts: the request goes to
    the rank with less prefill work queued, though the request counts are equal."""
    chooser = policy()
    a, b = prefills(2)
    features = RequestFeatures(text="x", tokens=TOKENS)
    with contextlib.ExitStack() as legs:
        for tokens in (2000, 2000):
            legs.enter_context(a.load(0, tokens=tokens))
        for tokens in (50, 50):
            legs.enter_context(b.load(0, tokens=tokens))
        assert a.load_score(0) == b.load_score(0) == 2
        for _ in range(3):
            assert chooser.choose_prefill([a, b], features).worker is b


def test_dp_ranks_are_separate_caches_and_predictions_follow_the_choice() -> None:
    chooser = policy(prediction_ttl_s=60)
    (worker,) = prefills(1, dp_size=4)
    store(chooser, ("p0", 2), 2)
    features = RequestFeatures(text="x", tokens=TOKENS)
    choice = chooser.choose_prefill([worker], features)
    assert (choice.rank, choice.cached_tokens) == (2, 8)
    chooser.record(choice, features)  # predicts the whole prompt at rank 2
    longer = RequestFeatures(text="x", tokens=[*TOKENS, 1, 2, 3, 4])
    assert chooser.choose_prefill([worker], longer).cached_tokens == 16


def test_approximate_without_token_ids_or_event_streams() -> None:
    chooser = CacheAware(CacheAwareSettings(), index=KVBlockIndex(100), tree=ApproxPrefixTree(1000))
    a, b = prefills(2)
    text = "system: be brief\nuser: hello\n"
    first = RequestFeatures(text=text)
    choice = chooser.choose_prefill([a, b], first)
    # nothing cached anywhere: load decides, the text is remembered for the next turn
    assert choice.how == "load" and choice.mode == "approximate" and choice.cached_tokens == 0
    chooser.record(choice, first)
    second = RequestFeatures(text=text + "assistant: hi\nuser: more\n")
    again = chooser.choose_prefill([a, b], second)
    assert again.worker is choice.worker and again.cached_tokens > 0
    chooser.forget(choice.worker.id)
    assert chooser.tree.size((choice.worker.id, 0)) == 0


def test_cache_aware_is_a_prefill_policy_and_decode_uses_least_load() -> None:
    cache = CacheAwareSettings()
    index, tree = KVBlockIndex(10), ApproxPrefixTree(10)
    prefill, decode = build_policies(PolicySettings(policy="cache_aware"), cache, index, tree)
    assert isinstance(prefill, CacheAware) and prefill.index is index
    assert decode.name == "least_load"
    assert build_policy("cache_aware").name == "cache_aware"


# --------------------------------------------------------------------------- through the router


def conversation(turns: int) -> dict[str, Any]:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "you are a helpful assistant that answers questions"}
    ]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f"answer number {turn}"})
        messages.append({"role": "user", "content": f"tell me about caches, part {turn}"})
    return {"model": MODEL, "messages": messages, "max_tokens": 3}


def served_by(engines: list[FakeEngine]) -> list[int]:
    """How many completions each engine got."""
    return [len(engine.records) for engine in engines]


async def test_approximate_turns_of_a_conversation_stay_on_one_prefill(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-mooncake", prefill=2, policy={"prefill_policy": "cache_aware"})
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=10) as client:
        for turns in range(1, 6):
            response = await client.post("/v1/chat/completions", json=conversation(turns))
            assert response.status_code == 200, response.text
        assert sorted(served_by(cluster.prefills)) == [0, 5]
        other = {**conversation(1), "messages": [{"role": "user", "content": "unrelated"}]}
        assert (await client.post("/v1/chat/completions", json=other)).status_code == 200
        assert sorted(served_by(cluster.prefills)) == [1, 5]  # new text: the idle one
        metrics = (await client.get("/metrics")).text
    # the first turn and the unrelated request found nothing cached: load chose
    assert 'pdr_routing_decisions_total{outcome="approximate",policy="cache_aware"} 4.0' in metrics
    assert 'pdr_routing_decisions_total{outcome="load",policy="cache_aware"} 2.0' in metrics
    assert 'pdr_routing_decision_seconds_count{policy="cache_aware"} 6.0' in metrics


async def test_a_prefill_leg_in_flight_counts_its_prompt_as_pending_work(
    make_cluster: FakeClusterFactory,
) -> None:
    """While a prefill leg runs, its rank carries the prompt's predicted uncached tokens (what
    ``cache_aware`` weighs against a cached prefix); they are released when the leg ends."""
    cluster = make_cluster("vllm-mooncake", prefill=1, policy={"prefill_policy": "cache_aware"})
    (prefill,) = cluster.prefills
    prefill.config.headers_delay = 1.0
    body = conversation(3)
    text = request_text(parse_request(Endpoint.CHAT, json.dumps(body).encode()))
    expected = RequestFeatures(text=text).prompt_tokens
    assert expected
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=10) as client:

        async def pending() -> int:
            workers = (await client.get("/admin/workers")).json()["workers"]
            (info,) = [w for w in workers if w["role"] == "prefill"]
            return int(info["live"]["ranks"][0]["pending_prefill_tokens"])

        request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        deadline = asyncio.get_running_loop().time() + 5
        while (seen := await pending()) == 0 and not request.done():
            assert asyncio.get_running_loop().time() < deadline, "no pending prefill work seen"
            await asyncio.sleep(0.01)
        assert seen == expected
        assert (await request).status_code == 200
        # the Mooncake decode may finish before the prefill's delayed answer: the leg's end counts
        while await pending() != 0:
            assert asyncio.get_running_loop().time() < deadline, "pending work never released"
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("engine", ["sglang", "vllm-mooncake"])
async def test_the_chosen_dp_rank_is_pinned_upstream(
    make_cluster: FakeClusterFactory, engine: Any
) -> None:
    cluster = make_cluster(engine, prefill=1, dp_size=4, policy={"policy": "cache_aware"})
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=10) as client:
        for turns in range(1, 5):
            response = await client.post("/v1/chat/completions", json=conversation(turns))
            assert response.status_code == 200, response.text
    ranks = [rank for record in cluster.prefills[0].records for rank in record.dp_ranks]
    assert len(ranks) == 4 and len(set(ranks)) == 1, ranks


def test_nixl_pins_a_dp_prefill_rank_with_the_vllm_header() -> None:
    (worker,) = prefills(1, dp_size=2)
    request = parse_request(Endpoint.COMPLETIONS, b'{"model": "m", "prompt": "x"}')
    plan = VllmNixlAdapter().plan(request, worker, 1, worker)
    assert plan.prefill_headers == {"x-data-parallel-rank": "1"}


Engines = tuple[list[FakeEngine], list[tuple[str, int | None]], FakeEngine, str]


@contextlib.contextmanager
def _engines(count: int) -> Iterator[Engines]:
    """``count`` vllm-mooncake fake prefills and one decode, served on 127.0.0.1."""
    fakes = [FakeEngine("prefill", "vllm-mooncake", config=FakeConfig()) for _ in range(count)]
    decode = FakeEngine("decode", "vllm-mooncake", config=FakeConfig())
    with contextlib.ExitStack() as stack:
        addrs = []
        for fake in fakes:
            ports = stack.enter_context(serve_engine(fake))
            addrs.append((f"http://127.0.0.1:{ports[0]}", ports[1] if len(ports) > 1 else None))
        decode_url = f"http://127.0.0.1:{stack.enter_context(serve_engine(decode))[0]}"
        yield fakes, addrs, decode, decode_url


@contextlib.asynccontextmanager
async def _publishers(count: int) -> AsyncIterator[list[KVEventPublisher]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
            )
            for _ in range(count)
        ]


async def _kv_blocks(client: httpx.AsyncClient, wid: str) -> int:
    for info in (await client.get("/admin/workers")).json()["workers"]:
        if info["id"] == wid and info["live"] and info["live"].get("ranks"):
            return int(info["live"]["ranks"][0]["kv_blocks"])
    return 0


async def test_precise_turns_follow_the_engines_kv_events(tmp_path: Path) -> None:
    """Two prefills whose event streams the test drives: after each turn the serving prefill
    "stores" the turn's blocks; the next turn must go there (predictions expire at once, so
    only the events can keep it there; round-robin ties would alternate)."""
    tokenizer_dir = tiny_tokenizer_dir(tmp_path / "tok")
    tokenizer = LocalTokenizer.from_dir(tokenizer_dir)
    async with _publishers(2) as pubs:
        with _engines(2) as (fakes, addrs, _, decode_url):
            settings = settings_for(
                "vllm-mooncake",
                addrs,
                [decode_url],
                policy={"prefill_policy": "cache_aware"},
                cache={"tokenizer": str(tokenizer_dir), "prediction_ttl_s": 0.001},
            )
            specs = [
                WorkerSpec(
                    url=url,
                    bootstrap_port=port,
                    kv_events=pub.endpoint,
                    kv_events_replay=pub.replay_endpoint,
                )
                for (url, port), pub in zip(addrs, pubs, strict=True)
            ]
            settings = settings.model_copy(update={"prefill": specs})
            with run_server(create_app(settings)) as port:
                base = f"http://127.0.0.1:{port}"
                wait_until(lambda: httpx.get(base + "/ready").status_code == 200, 10, "ready")
                async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                    await _drive(client, tokenizer, fakes, pubs, [u for u, _ in addrs])
                    metrics = (await client.get("/metrics")).text
    # the first turn, before any event, found nothing cached: load chose
    assert 'pdr_routing_decisions_total{outcome="load",policy="cache_aware"} 1.0' in metrics
    assert 'pdr_routing_decisions_total{outcome="precise",policy="cache_aware"} 3.0' in metrics
    assert "pdr_tokenize_seconds_count 4.0" in metrics


async def _drive(
    client: httpx.AsyncClient,
    tokenizer: LocalTokenizer,
    fakes: list[FakeEngine],
    pubs: list[KVEventPublisher],
    urls: list[str],
) -> None:
    chosen: int | None = None
    stored = 0
    for turns in range(1, 5):
        body = conversation(turns)
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        counts = served_by(fakes)
        index = counts.index(max(counts))
        assert chosen in (None, index), f"turn {turns} went to prefill {index}, not {chosen}"
        chosen = index
        assert sum(counts) == turns and counts[index] == turns
        request = parse_request(Endpoint.CHAT, json.dumps(body).encode())
        tokens = await tokenizer.tokens(request)
        assert tokens is not None
        keys = chain_keys(tokens, 4)
        new = list(range(1000 * turns + stored, 1000 * turns + len(keys)))
        parent = None if stored == 0 else 1000 * (turns - 1) + stored - 1
        event = BlockStored(new, parent, tokens[stored * 4 : len(keys) * 4], 4, None)
        wid = worker_id("prefill", urls[index])
        for _ in range(50):  # resent until the feed has subscribed (bounded: 5 s)
            await pubs[index].publish([event])
            if await _kv_blocks(client, wid) >= len(keys):
                break
            await asyncio.sleep(0.1)  # a resend interval; the condition is checked above
        assert await _kv_blocks(client, wid) >= len(keys)
        stored = len(keys)


def test_a_short_shared_header_does_not_pull_every_prompt_along() -> None:
    """Prompts sharing only a template header (below cache_threshold of the prompt) go by load;
    a prompt whose cached share crosses it follows the cache."""
    chooser = CacheAware(
        CacheAwareSettings(cache_threshold=0.5),
        index=KVBlockIndex(100),
        tree=ApproxPrefixTree(10**6),
    )
    a, b = prefills(2)
    header = "system: shared header\n"
    first_text = header + "user: " + "x" * 100
    first = RequestFeatures(text=first_text)
    chosen = chooser.choose_prefill([a, b], first)
    chooser.record(chosen, first)
    with chosen.worker.load(0):  # the chosen one is busier now
        other = chooser.choose_prefill([a, b], RequestFeatures(text=header + "user: " + "y" * 100))
        assert other.worker is not chosen.worker and other.how == "load"
        again = chooser.choose_prefill([a, b], RequestFeatures(text=first_text + " more"))
        assert again.worker is chosen.worker and again.how == "approximate"


def test_a_lora_adapters_request_goes_where_that_adapter_cached_the_prefix() -> None:
    """Both prefills serve the base model and its adapter: the base model's blocks at p0 do
    not attract the adapter's request, the adapter's own at p1 do; the text tree (approximate)
    keeps them apart too."""
    chooser = policy()
    a, b = prefills(2)
    chooser.index.apply_stored(("p0", 0), [1, 2, 3], None, TOKENS[:12], 4)
    chooser.index.apply_stored(("p1", 0), [4], None, TOKENS[:4], 4, lora_name="sql-lora")
    base = chooser.choose_prefill([a, b], RequestFeatures(text="x", tokens=TOKENS))
    assert (base.worker, base.cached_tokens) == (a, 12)
    adapted = RequestFeatures(text="x", tokens=TOKENS, adapter="sql-lora")
    choice = chooser.choose_prefill([a, b], adapted)
    assert (choice.worker, choice.cached_tokens) == (b, 4)
    tree = CacheAware(CacheAwareSettings(), index=KVBlockIndex(100), tree=ApproxPrefixTree(1 << 20))
    text = "a long system prompt shared by every request " * 4
    first = tree.choose_prefill([a, b], RequestFeatures(text=text))
    tree.record(first, RequestFeatures(text=text))
    assert tree.choose_prefill([a, b], RequestFeatures(text=text)).cached_tokens > 0
    adapter_text = RequestFeatures(text=text, adapter="sql-lora")
    assert tree.choose_prefill([a, b], adapter_text).cached_tokens == 0
