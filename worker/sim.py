"""The simulated engine instance behind ``worker.app``: its ranks, pools and transfer sides.

Roles: ``prefill`` computes the prompt's KV into its pool and sends it with ``KVSender`` to the
decode named by the request's PD fields (``worker.protocol``), through the lifecycle of
``worker.prefill`` (SGLang answers once the transfer reached Success, 500 with the reason
otherwise; vLLM answers after the forward pass and serves the pull in the background);
``decode`` allocates pages, receives the KV with ``KVReceiver`` from the prefill's bootstrap API,
verifies it and generates tokens from it; ``both`` computes the KV locally (the co-located
reference output). A prefill runs ``dp_size`` DP ranks in one process, each with its own pool,
transfer engine and sender (SGLang: rank ``routed_dp_rank``, else ``room % dp_size``; vLLM: the
``X-data-parallel-rank`` header, engine ids ``<id>_dp<rank>`` when ``dp_size`` > 1). Pages are
released on every path (withheld only when the transfer library says writes may still land in
them).

Each rank's pool is also a prefix cache (``worker.prefix_cache``, block keys from
``worker.block_hash``): a prefill, or a request computed locally (``both``, a vLLM decode without
``kv_transfer_params``), reuses its cached prefix pages and computes only the other tokens
(``compute_s_per_token`` applies to those); pages receiving KV from a prefill are never cached.
With ``kv_events`` set, every rank publishes its cache changes (``worker.kv_events``). The
prefill's cached token count travels to the decode in the aux slot, so the answer's
``usage.prompt_tokens_details.cached_tokens`` is the prefill's cache hit (as SGLang and vLLM's
NIXL decode report it; vLLM's Mooncake decode counts every received token), and
(vLLM protocols, chat answers) ``created_cache_tokens`` the prompt tokens computed in this process,
as vLLM 0.32 reports them. ``snapshots()`` and
``metrics`` give the load and cache signals (``worker.metrics``, ``worker.loads``).

With ``tiers`` (``worker.hicache.config.TierConfig``, host pages > 0) every rank also has a tiered
cache controller (``worker.hicache.controller``): L2 host memory and optionally an L3 page store,
opened in ``run()`` (its scan announces what a restarted worker already holds). A locally
computed request or a prefill then serves the prefix beyond its L1 hit from L2/L3 where it can:
the load runs layer by layer under the simulated forward pass (``worker.hicache.layer_loading``).
Without tiers nothing of this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import zmq.asyncio

from transfer.config import ReceiverConfig, SenderConfig
from transfer.engine.base import TransferEngine
from transfer.errors import TransferError
from transfer.receiver import KVReceiver, ReceiveFailed, ReceiveResult
from transfer.rendezvous import PrefillRank
from transfer.sender import KVSender
from worker.block_hash import BlockHasher, block_hasher
from worker.hicache.config import TierConfig, open_rank_store
from worker.hicache.controller import CacheController
from worker.hicache.layer_loading import simulate_forward
from worker.hicache.stores.base import EvictCallback, PageStore
from worker.kv import KVPool, PoolExhausted, PoolShape, detokenize, generate
from worker.kv_events import KVEventsConfig, open_rank_events
from worker.metrics import RankSnapshot, WorkerMetrics
from worker.prefill import PrefillJob, PrefillScheduler
from worker.protocol import PDProtocol, Seq, WorkerError
from worker.rank import AUX_LEN, AUX_SLOTS, Progress, Rank
from worker.tokenizer import PromptTokenizer, load_tokenizer

__all__ = [
    "Completion",
    "EngineFactory",
    "SimWorker",
    "StoreFactory",
    "TierConfig",
    "WorkerConfig",
    "WorkerError",
]

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
_T = TypeVar("_T")
EngineFactory = Callable[[], Awaitable[TransferEngine]]
StoreFactory = Callable[[int, EvictCallback], PageStore]
"""``(dp_rank, on_evict) -> that rank's L3 page store``."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Role
    model: str = "sim-model"
    shape: PoolShape = field(default_factory=PoolShape)
    protocol: PDProtocol = "sglang"  # how a prefill registers and reads its requests
    registry: str | None = None  # the registry whose bootstrap API a prefill publishes to
    namespace: str | None = None
    host: str = "127.0.0.1"  # control-plane bind address
    dp_size: int = 1  # prefill DP ranks in this process
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))  # vLLM engine id
    chunk_tokens: int = 2048  # chunked prefill: tokens per forward chunk
    max_prompt_tokens: int = 8192
    transfer_timeout_s: float = 30.0
    compute_s_per_token: float = 0.0  # simulated prefill forward time per prompt token
    decode_s_per_token: float = 0.0  # simulated time per generated token after the first
    tokenizer: str | None = None  # a Hugging Face tokenizer directory (None: bytes)
    hash_seed: str | None = None  # vLLM block hash root seed (None: random per process)
    kv_events: KVEventsConfig | None = None  # --kv-events-config
    tiers: TierConfig = field(default_factory=TierConfig)  # --hicache-* (default: none)

    def __post_init__(self) -> None:
        if self.dp_size < 1 or (self.dp_size > 1 and self.role != "prefill"):
            raise ValueError(f"dp_size={self.dp_size}: only a prefill runs more than one rank")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.compute_s_per_token < 0 or self.decode_s_per_token < 0:
            raise ValueError("simulated compute times must be >= 0")


@dataclass(frozen=True, slots=True)
class Completion:
    """One sequence's outcome: its text, token counts and what its KV transfer moved and took."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    kv_bytes: int
    transfer_s: float
    cached_tokens: int = 0  # prompt tokens served from the (prefill's) prefix cache
    # prompt tokens computed in this process (vLLM >= 0.32 reports them as
    # ``created_cache_tokens``); None: not reported (SGLang)
    computed_tokens: int | None = None


class SimWorker:
    """One simulated engine instance; ``run()`` opens its engines, pools and transfer sides."""

    def __init__(
        self,
        config: WorkerConfig,
        engine: EngineFactory | None,
        *,
        page_store: StoreFactory | None = None,
    ) -> None:
        """``page_store``: each rank's L3 (default: the one ``config.tiers`` names)."""
        self.config = config
        self.ranks = [Rank(KVPool(config.shape)) for _ in range(config.dp_size)]
        self.tokenizer: PromptTokenizer = load_tokenizer(config.tokenizer)
        self.metrics = WorkerMetrics(
            config.protocol, config.model, self.snapshots, tiers=config.tiers.enabled
        )
        self._hasher: BlockHasher = block_hasher(config.protocol, config.hash_seed)
        self._engine_factory = engine
        self._page_store = page_store or self._open_store
        self._add_tiers()

    def _add_tiers(self) -> None:
        cfg, metrics = self.config, self.metrics.tiers
        if metrics is None:
            return
        for index, rank in enumerate(self.ranks):
            rank.tiers = CacheController(cfg.tiers, rank.pool, metrics.rank(index))
        if cfg.tiers.storage and cfg.protocol != "sglang" and cfg.hash_seed is None:
            logger.warning(
                "vLLM block keys without --hash-seed change with every start: pages stored "
                "by an earlier run will never match"
            )

    def _open_store(self, rank: int, on_evict: EvictCallback) -> PageStore:
        cfg = self.config
        prefix = f"{cfg.model}/{cfg.protocol}/"
        return open_rank_store(cfg.tiers, rank, cfg.dp_size, prefix, on_evict)

    @property
    def pool(self) -> KVPool:
        return self.ranks[0].pool

    @property
    def pools(self) -> list[KVPool]:
        return [rank.pool for rank in self.ranks]

    @property
    def sender(self) -> KVSender | None:
        return self.ranks[0].sender

    @property
    def receiver(self) -> KVReceiver | None:
        return self.ranks[0].receiver

    @property
    def open_rooms(self) -> int:
        """Transfer rooms started and not yet released on this worker's side."""
        return sum(
            r.sender.open_rooms
            if r.sender is not None
            else r.receiver.open_rooms
            if r.receiver is not None
            else 0
            for r in self.ranks
        )

    @property
    def kv_bytes_sent(self) -> int:
        """KV and aux bytes this prefill's ranks have written into decode memory."""
        return sum(r.sender.stats.bytes_written for r in self.ranks if r.sender is not None)

    @property
    def queues(self) -> dict[str, int]:
        """Prefill requests per lifecycle stage (``worker.prefill``), over all ranks."""
        total: dict[str, int] = {}
        for rank in self.ranks:
            if rank.scheduler is not None:
                for stage, count in rank.scheduler.counts.items():
                    total[stage] = total.get(stage, 0) + count
        return total

    def engine_id(self, dp_rank: int) -> str:
        cfg = self.config
        return cfg.engine_id if cfg.dp_size == 1 else f"{cfg.engine_id}_dp{dp_rank}"

    @property
    def event_endpoints(self) -> list[tuple[str, str | None]]:
        """Each rank's bound KV event (live, replay) endpoints; empty when events are off."""
        return [
            (r.events.publisher.endpoint, r.events.publisher.replay_endpoint)
            for r in self.ranks
            if r.events is not None
        ]

    def tier_status(self) -> list[dict[str, object]] | None:
        """Each rank's tier occupancy (None without tiers), for ``/health``."""
        if not self.config.tiers.enabled:
            return None
        return [rank.tiers.status() for rank in self.ranks if rank.tiers is not None]

    def snapshots(self) -> list[RankSnapshot]:
        """Every rank's load and cache counters now (``worker.metrics``)."""
        return [rank.snapshot(index) for index, rank in enumerate(self.ranks)]

    def reset_prefix_cache(self) -> None:
        """Drop every rank's cached blocks (``AllBlocksCleared`` on each rank's feed), L2 too;
        L3 stays and is announced again."""
        for rank in self.ranks:
            rank.pool.cache.clear()
            if rank.tiers is not None:
                rank.tiers.clear()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Count one request as being served (decode and ``both``: running until it ends)."""
        stats = self.ranks[0].stats
        stats.active += 1
        try:
            yield
        finally:
            stats.active -= 1

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Open the KV event publishers, the cache tiers and the transfer sides; close them on
        exit."""
        events = self.config.kv_events
        transfer = self.config.role != "both" and self._engine_factory is not None
        tiers = self.config.tiers.enabled
        if not transfer and not tiers and (events is None or not events.enabled):
            yield
            return
        context = zmq.asyncio.Context()
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self._open_events(stack, context)
                await self._open_tiers(stack)
                if transfer:
                    await self._open_transfer(stack, context)
                yield
        finally:
            context.term()

    async def _open_events(
        self, stack: contextlib.AsyncExitStack, context: zmq.asyncio.Context
    ) -> None:
        config = self.config.kv_events
        if config is None or not config.enabled:
            return
        for index, rank in enumerate(self.ranks):
            events = await stack.enter_async_context(
                open_rank_events(config, index, self.config.host, context)
            )
            rank.events = events
            rank.pool.cache.events = events.emit
            stack.callback(setattr, rank.pool.cache, "events", None)
            stack.callback(setattr, rank, "events", None)
            if rank.tiers is not None:
                rank.tiers.events = events.emit
                stack.callback(setattr, rank.tiers, "events", None)

    async def _open_tiers(self, stack: contextlib.AsyncExitStack) -> None:
        """Start each rank's cache controller, with its L3 store when one is configured."""
        for index, rank in enumerate(self.ranks):
            tiers = rank.tiers
            if tiers is None:
                continue
            store = None
            if self.config.tiers.storage:
                store = self._page_store(index, tiers.store_evicted)
            await tiers.start(store)
            stack.push_async_callback(tiers.aclose)

    async def _open_transfer(
        self, stack: contextlib.AsyncExitStack, context: zmq.asyncio.Context
    ) -> None:
        assert self._engine_factory is not None
        for index, rank in enumerate(self.ranks):
            engine = await self._engine_factory()
            stack.push_async_callback(engine.close)
            await stack.enter_async_context(self._transfer_side(context, engine, index, rank))

    @contextlib.asynccontextmanager
    async def _transfer_side(
        self, context: zmq.asyncio.Context, engine: TransferEngine, index: int, rank: Rank
    ) -> AsyncIterator[None]:
        cfg = self.config
        if cfg.role == "prefill":
            place = PrefillRank(
                page_size=cfg.shape.page_size,
                system_dp_size=cfg.dp_size,
                system_dp_rank=index,
                engine_id=self.engine_id(index) if cfg.protocol == "vllm-mooncake" else None,
            )
            sender_config = SenderConfig(
                registry=cfg.registry,
                namespace=cfg.namespace,
                host=cfg.host,
                aux_item_len=AUX_LEN,
                aux_slots=AUX_SLOTS,
                bootstrap_timeout_s=cfg.transfer_timeout_s,
                transfer_timeout_s=cfg.transfer_timeout_s,
            )
            async with KVSender(context, engine, rank.pool.layout, place, sender_config) as sender:
                scheduler = PrefillScheduler(
                    rank.pool,
                    sender,
                    chunk_tokens=cfg.chunk_tokens,
                    compute_s_per_token=cfg.compute_s_per_token,
                    layerwise=cfg.tiers.layerwise,
                )
                rank.sender, rank.scheduler = sender, scheduler
                try:
                    yield
                finally:
                    await scheduler.aclose()
        else:
            receiver_config = ReceiverConfig(
                host=cfg.host, aux_item_len=AUX_LEN, aux_slots=AUX_SLOTS
            )
            async with KVReceiver(context, engine, rank.pool.layout, receiver_config) as receiver:
                rank.receiver = receiver
                yield

    # --- requests ------------------------------------------------------------------------------

    async def complete(self, seq: Seq, max_new: int) -> Completion:
        limit = min(self.config.max_prompt_tokens, self.pool.max_tokens)
        if not seq.tokens:
            raise WorkerError(400, "empty prompt")
        if len(seq.tokens) > limit:
            raise WorkerError(400, f"prompt of {len(seq.tokens)} tokens is longer than {limit}")
        role, started = self.config.role, time.monotonic()
        if role == "both" or seq.local:
            index, result = 0, await self._local(self.ranks[0], seq, max_new)
        elif role == "prefill":
            index = self._prefill_rank(seq)
            result = await self._prefill(self.ranks[index], seq)
        else:
            index, result = 0, await self._decode(self.ranks[0], seq, max_new)
        self.metrics.observe_ttft(index, time.monotonic() - started)
        if self.config.protocol == "sglang":
            return result
        # what vLLM >= 0.32 reports as created_cache_tokens: a decode that received the KV
        # computed none of the prompt
        computed = (
            0 if role == "decode" and not seq.local else len(seq.tokens) - result.cached_tokens
        )
        return dataclasses.replace(result, computed_tokens=computed)

    def _prefill_rank(self, seq: Seq) -> int:
        dp_size, room = self.config.dp_size, seq.room
        if room is None:
            raise WorkerError(
                400,
                "a prefill request needs bootstrap_room "
                "(vLLM: kv_transfer_params with a transfer_id)",
            )
        dp = seq.dp_rank
        if dp is not None and not 0 <= dp < dp_size:
            raise WorkerError(400, f"DP rank {dp} outside [0, {dp_size})")
        if self.config.protocol == "sglang" and dp_size > 1:
            if dp is not None and dp != room % dp_size:
                raise WorkerError(
                    400,
                    f"follow_bootstrap_room conflict: routed_dp_rank {dp} "
                    f"but bootstrap_room % {dp_size} = {room % dp_size}",
                )
            dp = room % dp_size
        return dp or 0

    def _lease(self, rank: Rank, seq: Seq) -> contextlib.AbstractContextManager[Progress]:
        return rank.lease(seq.tokens, self._hasher(seq.tokens, self.config.shape.page_size))

    @contextlib.contextmanager
    def _pages(self, rank: Rank, seq: Seq) -> Iterator[_Held]:
        """Pages for ``seq`` on ``rank``, released afterwards (quarantined when not ``safe``)."""
        try:
            held = _Held(rank.pool.allocate(len(seq.tokens)))
        except PoolExhausted as exc:
            raise WorkerError(503, str(exc)) from exc
        try:
            yield held
        finally:
            if held.safe:
                rank.pool.release(held.pages)
            else:
                rank.pool.quarantine(held.pages)

    async def _local(self, rank: Rank, seq: Seq, max_new: int) -> Completion:
        cfg = self.config
        with self._lease(rank, seq) as lease:
            await lease.ready()
            start, load = await lease.begin()
            compute_s = cfg.compute_s_per_token * (len(seq.tokens) - start)
            await simulate_forward(compute_s, cfg.shape.layers, load, cfg.tiers.layerwise)
            rank.pool.write(lease.pages, seq.tokens, start)
            lease.computed(len(seq.tokens))
            done = self._decode_tokens(rank.pool, seq, lease.pages, max_new, 0, 0.0)
            return dataclasses.replace(done, cached_tokens=start)

    async def _prefill(self, rank: Rank, seq: Seq) -> Completion:
        assert rank.scheduler is not None and seq.room is not None
        if self.config.protocol == "vllm-mooncake":
            return await self._prefill_and_hand_off(rank, rank.scheduler, seq)
        with self._lease(rank, seq) as lease:
            job = self._job(seq, lease)
            try:
                transfer_s = await rank.scheduler.run(job)
            except TransferError as exc:
                raise WorkerError(500, f"KV transfer failed: {exc}") from exc
        return Completion("", len(seq.tokens), 0, 0, transfer_s, lease.cached_tokens)

    def _job(self, seq: Seq, lease: Progress) -> PrefillJob:
        room = seq.room
        assert room is not None

        def aux() -> bytes:  # when sent: the cached count includes what came from L2/L3
            return struct.pack("<QQQ", len(seq.tokens), room & ((1 << 64) - 1), lease.cached_tokens)

        tiers = lease if lease.rank.tiers is not None else None
        return PrefillJob(
            room, seq.tokens, lease.pages, aux, lease.cached_tokens, lease.computed, tiers
        )

    async def _prefill_and_hand_off(
        self, rank: Rank, scheduler: PrefillScheduler, seq: Seq
    ) -> Completion:
        with contextlib.ExitStack() as stack:
            lease = stack.enter_context(self._lease(rank, seq))
            job = self._job(seq, lease)
            await scheduler.compute(job)
            scheduler.hand_off(job, stack.pop_all().close)
        return Completion("", len(seq.tokens), 0, 0, 0.0, lease.cached_tokens)

    async def _decode(self, rank: Rank, seq: Seq, max_new: int) -> Completion:
        if rank.receiver is None or seq.room is None or seq.bootstrap is None:
            raise WorkerError(
                400, "a decode request needs bootstrap_host/port/room (vLLM: kv_transfer_params)"
            )
        if not rank.aux_free:
            raise WorkerError(503, "no free aux slot")
        with self._pages(rank, seq) as held, rank.receiving():
            got = await self._receive(rank, rank.receiver, seq, held)
            length, _, cached = struct.unpack("<QQQ", got.aux[:AUX_LEN])
            if length != len(seq.tokens):
                raise WorkerError(500, "aux from the prefill names another prompt length")
            rank.stats.received_tokens += length
            done = self._decode_tokens(
                rank.pool, seq, held.pages, max_new, got.kv_bytes, got.elapsed_s
            )
            if self.config.protocol == "vllm-mooncake":
                # vLLM's Mooncake decode counts what it did not compute: every received token
                # (the router writes its kv_transfer_params: no remote_prefill_cached_tokens)
                cached = length
            return dataclasses.replace(done, cached_tokens=cached)

    async def _receive(
        self, rank: Rank, receiver: KVReceiver, seq: Seq, held: _Held
    ) -> ReceiveResult:
        """``seq``'s KV into ``held``'s pages through an aux slot; ``held.safe`` and the aux slot
        follow the transfer's outcome (``WorkerError`` 500 when it failed).

        Cancelled (the client went away, a sibling sequence failed), it fails the room at once:
        the receiver aborts it at the prefill and learns whether the pages are safe (within its
        drain timeout) before ``CancelledError`` goes on, so the pages come back now rather than
        at the transfer deadline, and never while a write may still land in them.
        """
        room = seq.room
        assert room is not None and seq.bootstrap is not None
        aux_index = rank.aux_free.pop()
        request = asyncio.ensure_future(
            receiver.request(
                room,
                seq.bootstrap,
                held.pages,
                aux_index,
                self.config.transfer_timeout_s,
                dp_rank=seq.source_dp_rank,
                engine_id=seq.engine_id,
            )
        )
        try:
            return await _settled(request, lambda: receiver.cancel(room, _CANCELLED))
        except (TransferError, ValueError) as exc:  # ReceiveFailed included
            raise WorkerError(500, f"KV transfer failed: {exc}") from exc
        finally:
            held.safe = _pages_safe(request)
            if held.safe:
                rank.aux_free.append(aux_index)

    def _decode_tokens(
        self,
        pool: KVPool,
        seq: Seq,
        pages: list[int],
        max_new: int,
        kv_bytes: int,
        transfer_s: float,
    ) -> Completion:
        digest, bad = pool.read_digest(pages, seq.tokens)
        if bad >= 0:
            raise WorkerError(500, f"received KV does not match the prompt at position {bad}")
        tokens = generate(digest, max_new)
        return Completion(detokenize(tokens), len(seq.tokens), len(tokens), kv_bytes, transfer_s)


_CANCELLED = "the decode request was cancelled (its client went away)"


@dataclass(slots=True)
class _Held:
    """A decode request's pages; not ``safe`` (a transfer may still write them): withheld."""

    pages: list[int]
    safe: bool = True


async def _settled(work: asyncio.Future[_T], stop: Callable[[], object]) -> _T:
    """``work``'s result; when the caller is cancelled, ``stop()`` and wait for ``work`` to end
    (it must end soon after ``stop``; further cancellations wait too) before re-raising."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        stop()
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({work})
        if not work.cancelled():
            work.exception()  # retrieved: the caller learns the outcome from the future
        raise


def _pages_safe(request: asyncio.Future[ReceiveResult]) -> bool:
    """Whether a receive's destination pages (and aux slot) may be reused now."""
    if not request.done() or request.cancelled():
        return False  # the receiver aborts a cancelled request in the background
    error = request.exception()
    return not isinstance(error, ReceiveFailed) or error.pages_safe
