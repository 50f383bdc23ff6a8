"""The simulated engine instance behind ``worker.app``: its ranks, pools and transfer sides.

Roles: ``prefill`` sends the KV it computes with ``KVSender``, ``decode`` receives it with
``KVReceiver``, ``both`` computes it locally (the co-located reference output); what each does
with a request is ``worker.serving``. A prefill runs ``dp_size`` DP ranks in one process
(``worker.rank``), each with its own pool, transfer engine and sender (vLLM engine ids
``<id>_dp<rank>`` when ``dp_size`` > 1).

Each rank's pool is also a prefix cache (``worker.prefix_cache``, block keys from
``worker.block_hash``); pages receiving KV from a prefill are never cached. With ``kv_events``
set, every rank publishes its cache changes (``worker.kv_events``). ``snapshots()`` and
``metrics`` give the load and cache signals (``worker.metrics``, ``worker.loads``).

With ``tiers`` (``worker.hicache.config.TierConfig``, host pages > 0) every rank also has a tiered
cache controller (``worker.hicache.controller``): L2 host memory and optionally an L3 page store,
opened in ``run()`` (its scan announces what a restarted worker already holds). A locally
computed request or a prefill then serves the prefix beyond its L1 hit from L2/L3 where it can:
the load runs layer by layer under the simulated forward pass (``worker.hicache.layer_loading``).
Without tiers nothing of this runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import zmq.asyncio

from transfer.config import ReceiverConfig, SenderConfig
from transfer.engine.base import TransferEngine
from transfer.receiver import KVReceiver
from transfer.rendezvous import PrefillRank
from transfer.sender import KVSender
from worker.block_hash import BlockHasher, block_hasher
from worker.config import WorkerConfig
from worker.hicache.config import TierConfig, open_rank_store
from worker.hicache.controller import CacheController
from worker.hicache.stores.base import EvictCallback, PageStore
from worker.kv import KVPool
from worker.kv_events import open_rank_events
from worker.metrics import RankSnapshot, WorkerMetrics
from worker.page_queue import PageQueue
from worker.prefill import PrefillScheduler
from worker.protocol import Seq, WorkerError
from worker.rank import AUX_LEN, AUX_SLOTS, Rank
from worker.serving import Completion, RequestServer
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

EngineFactory = Callable[[], Awaitable[TransferEngine]]
StoreFactory = Callable[[int, EvictCallback], PageStore]
"""``(dp_rank, on_evict) -> that rank's L3 page store``."""


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
        self.ranks = [
            Rank(
                KVPool(config.shape),
                queue=PageQueue(config.max_queued_requests, config.page_wait_s),
            )
            for _ in range(config.dp_size)
        ]
        self.tokenizer: PromptTokenizer = load_tokenizer(config.tokenizer)
        self.metrics = WorkerMetrics(
            config.protocol, config.model, self.snapshots, tiers=config.tiers.enabled
        )
        hasher: BlockHasher = block_hasher(
            config.protocol, config.hash_seed, rehash=config.rehash_each_request
        )
        self._server = RequestServer(config, self.ranks, hasher, self.metrics)
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
    def waiting_for_pages(self) -> int:
        """Requests of any role waiting for KV pages (``worker.page_queue``), over all ranks."""
        return sum(rank.queue.waiting for rank in self.ranks)

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
                host=cfg.host,
                aux_item_len=AUX_LEN,
                aux_slots=AUX_SLOTS,
                drain_timeout_s=cfg.kv_drain_timeout_s,
            )
            async with KVReceiver(context, engine, rank.pool.layout, receiver_config) as receiver:
                rank.receiver = receiver
                yield

    # --- requests ------------------------------------------------------------------------------

    async def complete(self, seq: Seq, max_new: int) -> Completion:
        """Serve one sequence by the worker's role (``worker.serving``)."""
        return await self._server.complete(seq, max_new)
