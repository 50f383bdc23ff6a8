"""Workers as the router sees them: address, layout, health and in-flight load, and the pool."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

import httpx

from registry.models import redact_url
from router.errors import WorkersBusy
from router.leg_load import LegLoad
from router.leg_stats import LegStats
from router.load_board import DISPATCHED, LEGS, TOKENS, HostLoad, LoadBoard
from router.worker_load import EngineLoad, FleetCounts, LoadReading, format_host

__all__ = ["EngineLoad", "FleetCounts", "LoadReading", "Role", "Worker", "WorkerPool"]
__all__ += ["MAX_MODELS_PER_WORKER", "format_host"]

logger = logging.getLogger(__name__)

MAX_MODELS_PER_WORKER = 64  # names kept per worker: the model label's and pools' bound
_NONE: tuple[list[Worker], ...] = ([], [])  # the pools of a model nobody serves
Names = frozenset[str]
_NO_NAMES: Names = frozenset()


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False, slots=True)
class Worker:
    """One engine instance. Mutable state is owned by the router's event loop (no locks)."""

    role: Role
    url: str
    bootstrap_port: int | None = None
    id: str = ""
    healthy: bool = False
    draining: bool = False
    epoch: int = 1
    probe_failures: int = 0  # failed health probes in a row
    probe_successes: int = 0  # good health probes in a row
    seen_healthy: bool = False  # a new worker needs one good probe, a fallen one more
    last_success: float = -1e18  # time.monotonic() of the last request it served
    full_until: float = 0.0  # monotonic time until which it is avoided: it said it is full
    inflight: int = 0
    dp_size: int = 1
    engine_ids: tuple[str, ...] = ()  # vLLM Mooncake: engine id per DP rank, from /query
    rank_inflight: list[int] = field(default_factory=lambda: [0])
    rank_turn: int = 0  # this prefill's own round-robin cursor over tied DP ranks
    # requests this router ever sent to each DP rank (only grows): credits since a reading
    rank_dispatched: list[int] = field(default_factory=lambda: [0])
    # prompt tokens this router's in-flight prefill legs are predicted to compute, per DP rank
    rank_pending_tokens: list[int] = field(default_factory=lambda: [0])
    # each DP rank's last load report from its engine, None: unknown (never read, read failed)
    engine_load: list[LoadReading | None] = field(default_factory=lambda: [None])
    # the prefill's KV event stream (DP rank 0; rank r at port + r), None: not known
    kv_events: str | None = None
    kv_events_replay: str | None = None
    host: str = ""
    # Where decoders reach the prefill's bootstrap server: the prefill's own host by default; the
    # router's registry (advertised host, namespace port or path) when the prefill registers there.
    bootstrap_namespace: str | None = None
    bootstrap_host: str = ""
    bootstrap_path: str = ""
    # the URL as shown (errors, headers, metrics, pages): any user:password@ hidden
    public_url: str = ""
    # request-path outlier detection: its legs' timestamps, and whether it ejected this worker
    # (marked down; probes bring it back, not before ``ejected_until``: time.monotonic())
    legs: LegStats = field(default_factory=LegStats)
    ejected: bool = False
    ejected_until: float = 0.0
    # router --workers N: its DP ranks' counts on the host's load board (every process's legs)
    host_load: HostLoad | None = None
    # --replica-listen: the replica peers' legs and pending tokens here (router.fleet.replica_sync)
    fleet_load: FleetCounts | None = None
    # the model names it serves (declared, or read from its /v1/models); empty: not known, it
    # is a candidate for any model (``WorkerPool.set_models``, router.scheduling.model_pools)
    models: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()  # those of them it serves as LoRA adapters
    models_declared: bool = False  # from its spec or record: never replaced by what it lists
    leg_ended: Callable[[], None] | None = None  # each leg's end (router.pipeline.worker_queue)
    _loss: asyncio.Future[str] | None = None  # resolved (why) when lost: its KV's waiters end

    def __post_init__(self) -> None:
        self.public_url = redact_url(self.url)
        self.host = format_host(httpx.URL(self.url).host)
        self.bootstrap_host = self.bootstrap_host or self.host
        if not self.id:
            self.id = f"{self.role.value}:{self.url}"

    @property
    def bootstrap_addr(self) -> str:
        """``http://host:port[/path]`` of the prefill's bootstrap server."""
        return f"http://{self.bootstrap_host}:{self.bootstrap_port}{self.bootstrap_path}"

    def set_layout(self, dp_size: int, engine_ids: tuple[str, ...] = ()) -> None:
        """Record the prefill's DP layout (from its bootstrap server); new engine ids mean the
        engines restarted: the KV of requests it answered is gone."""
        if self.engine_ids and engine_ids != self.engine_ids:
            self.signal_loss(f"its engine ids changed from {list(self.engine_ids)}")
        self.engine_ids = engine_ids
        if dp_size != self.dp_size:
            self.dp_size = dp_size
            self.rank_inflight = [0] * dp_size
            self.rank_dispatched = [0] * dp_size
            self.rank_pending_tokens = [0] * dp_size
            self.engine_load = [None] * dp_size
            if self.host_load is not None:
                self.host_load.resize(dp_size)

    def load(self, rank: int = 0, tokens: int = 0) -> LegLoad:
        """Count one in-flight request (and DP rank) for as long as the block runs, and one more
        request dispatched to the rank (credited to it until the engine's next load report);
        ``tokens``: the prompt tokens it is predicted to compute there, pending meanwhile. The
        leg's start and end go to ``legs`` (outlier detection)."""
        return LegLoad(self, rank, tokens)

    def pending_tokens(self, rank: int) -> int:
        """Prompt tokens this router's in-flight prefill legs at ``rank`` are predicted to
        compute (the prefill work queued there by this router: with ``--workers N``, by every
        process of the host)."""
        return self._counted(rank, TOKENS, self.rank_pending_tokens)

    def rank_load(self, rank: int) -> int:
        """This router's legs in flight at ``rank`` (with ``--workers N``: the host's)."""
        return self._counted(rank, LEGS, self.rank_inflight)

    def _counted(self, rank: int, field: int, own: list[int]) -> int:
        host, fleet = self.host_load, self.fleet_load
        count = None if host is None else host.count(rank, field)
        if count is None:
            count = own[rank] if rank < len(own) else 0
        return count if fleet is None else count + fleet.count(self.id, rank, field)

    def host_inflight(self) -> int:
        """This router's legs in flight at the worker (with ``--workers N``: the host's; with
        replica peers: theirs too)."""
        if self.host_load is None and self.fleet_load is None:
            return self.inflight
        return sum(self.rank_load(rank) for rank in range(len(self.rank_inflight)))

    def load_score(self, rank: int | None = None) -> float:
        """Work queued at this worker (or one DP rank), for load-aware choices: the engine's
        own report (running + waiting) plus what this router sent since that reading when a
        fresh reading exists; else this router's in-flight count."""
        if rank is None:
            return self._total_score()
        if rank >= len(self.rank_inflight):
            return 0.0
        reading = self.engine_load[rank]
        if reading is None or time.monotonic() >= reading.fresh_until:
            return float(self.rank_load(rank))
        sent = self._counted(rank, DISPATCHED, self.rank_dispatched)
        return reading.queued + max(sent - reading.dispatched, 0)

    def _total_score(self) -> float:
        """Sum over the DP ranks; this router's in-flight count when any rank's load is unknown."""
        now = time.monotonic()
        total = 0.0
        for reading, dispatched in zip(self.engine_load, self.dispatched_counts(), strict=True):
            if reading is None or now >= reading.fresh_until:
                return float(self.host_inflight())
            total += reading.queued + max(dispatched - reading.dispatched, 0)
        return total

    def dispatched_counts(self) -> list[int]:
        """Requests this router ever sent to each DP rank (with ``--workers N``: the host's)."""
        own = self.rank_dispatched
        return [self._counted(rank, DISPATCHED, own) for rank in range(len(own))]

    def engine_waiting(self, rank: int | None = None) -> float | None:
        """Requests waiting at the engine (one DP rank, or all) as it last reported them (no
        credits); None when unknown or stale (for all ranks: when any rank is)."""
        now = time.monotonic()
        readings = self.engine_load if rank is None else self.engine_load[rank : rank + 1]
        total = 0.0
        for reading in readings:
            if reading is None or now >= reading.fresh_until:
                return None
            total += reading.load.waiting
        return total if readings else None

    def engine_load_known(self, rank: int | None = None) -> bool:
        """Whether a fresh engine report backs ``load_score(rank)`` (for all ranks: every one)."""
        now = time.monotonic()
        readings = self.engine_load if rank is None else self.engine_load[rank : rank + 1]
        return bool(readings) and all(r is not None and now < r.fresh_until for r in readings)

    def record_engine_load(
        self,
        loads: list[EngineLoad | None],
        *,
        at: float,
        stale_after: float,
        dispatched: list[int],
    ) -> None:
        """Keep one engine report per DP rank (None: that rank unknown). ``dispatched`` is the
        ranks' dispatch counters when the read began: requests sent after it are credited."""
        if len(loads) != self.dp_size:
            raise ValueError(f"{len(loads)} rank loads for dp_size={self.dp_size}")
        if len(dispatched) != self.dp_size:  # the layout changed during the read
            dispatched = self.dispatched_counts()
        self.engine_load = [
            None
            if load is None
            else LoadReading(load, at, at + stale_after, sent, load.running + load.waiting)
            for load, sent in zip(loads, dispatched, strict=True)
        ]

    def forget_engine_load(self) -> None:
        """The engine's load is unknown (a read failed): fall back to in-flight counts."""
        self.engine_load = [None] * self.dp_size

    def loss_signal(self) -> asyncio.Future[str]:
        """A future resolved with a reason when this worker is lost (down, restarted)."""
        if self._loss is None:
            self._loss = asyncio.get_running_loop().create_future()
        return self._loss

    def signal_loss(self, reason: str) -> None:
        """Tell every request bound to this worker that it is lost."""
        loss, self._loss = self._loss, None
        if loss is not None and not loss.done():
            loss.set_result(reason)

    def mark_up(self) -> None:
        self.healthy, self.seen_healthy, self.ejected = True, True, False

    def mark_down(self, reason: str) -> None:
        self.healthy = False
        self.probe_successes = 0  # coming back takes fresh good probes
        self.signal_loss(f"it became unhealthy ({reason})")

    def record_success(self) -> None:
        """It served a request (failed ones feed its circuit breaker: router.pipeline.verdicts)."""
        self.last_success = time.monotonic()


C = TypeVar("C")


class WorkerPool(Generic[C]):
    """The workers the router may route to, each with its upstream client ``C``.

    Membership changes at runtime (registry); the role lists are replaced, never mutated, so a
    request that already picked a worker is unaffected. A removed worker keeps its client until
    its in-flight requests are done (``removed`` hands both back to the caller to close).

    The routing candidates (``available_*``) leave out a worker at its in-flight cap
    (``caps``: prefill, decode; 0: none) and, while another candidate exists, one that said it
    is full less than ``capacity_backoff_s`` ago (``back_off``).
    """

    def __init__(
        self,
        *,
        needs_engine_ids: bool,
        caps: tuple[int, int] = (0, 0),
        capacity_backoff_s: float = 0.0,
        retry_after_s: int = 1,
        board: LoadBoard | None = None,
    ) -> None:
        self._needs_engine_ids = needs_engine_ids
        self._board = board
        self._fleet: FleetCounts | None = None
        self._prefill_cap, self._decode_cap = caps
        self._backoff_s = capacity_backoff_s
        self._retry_after_s = retry_after_s
        self._backoff_until = 0.0  # the latest full_until of any worker: none avoided after it
        self._workers: dict[str, Worker] = {}
        self._clients: dict[str, C] = {}
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self.models: frozenset[str] = frozenset()
        self.adapters: frozenset[str] = frozenset()  # served as a LoRA adapter by some worker
        self.wildcards = False
        self._pools: dict[str, tuple[list[Worker], ...]] = {}
        self.leg_ended: Callable[[], None] | None = None  # set before workers are added

    def add(self, worker: Worker, client: C) -> None:
        if self._board is not None:
            worker.host_load = HostLoad(self._board, worker.id, worker.dp_size)
        worker.fleet_load = self._fleet
        worker.leg_ended = self.leg_ended
        self._workers[worker.id] = worker
        self._clients[worker.id] = client
        self._rebuild()

    def remove(self, worker_id: str) -> tuple[Worker, C] | None:
        """Take a worker out of routing; returns it with its client, or None if unknown."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return None
        self._rebuild()
        return worker, self._clients.pop(worker_id)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def count_fleet(self, fleet: FleetCounts) -> None:
        """Every worker's counts, now and added later, include the replica peers'."""
        self._fleet = fleet
        for worker in self._workers.values():
            worker.fleet_load = fleet

    def client(self, worker: Worker) -> C:
        return self._clients[worker.id]

    def clients(self) -> list[C]:
        return list(self._clients.values())

    def all(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    def usable_prefill(self, model: str | None = None) -> list[Worker]:
        """Healthy, not draining, layout known: whatever their load (``model``: serving it, or
        not known to serve any one model)."""
        prefill = self.prefill if model is None else self._pools.get(model, _NONE)[0]
        if self._needs_engine_ids:
            return [w for w in prefill if w.healthy and not w.draining and w.engine_ids]
        return [w for w in prefill if w.healthy and not w.draining]

    def usable_decode(self, model: str | None = None) -> list[Worker]:
        decode = self.decode if model is None else self._pools.get(model, _NONE)[1]
        return [w for w in decode if w.healthy and not w.draining]

    def available_prefill(self, model: str | None = None) -> list[Worker]:
        """The prefill candidates for a request now; raises WorkersBusy when every usable one
        is at its in-flight cap."""
        return self._candidates(self.usable_prefill(model), self._prefill_cap)

    def available_decode(self, model: str | None = None) -> list[Worker]:
        return self._candidates(self.usable_decode(model), self._decode_cap)

    def set_models(
        self, worker: Worker, names: Names, *, declared: bool, adapters: Names = _NO_NAMES
    ) -> None:
        """The models ``worker`` serves (at most ``MAX_MODELS_PER_WORKER`` names, sorted) and
        which of them are LoRA adapters."""
        worker.models = frozenset(sorted(names)[:MAX_MODELS_PER_WORKER])
        worker.adapters, worker.models_declared = adapters & worker.models, declared
        self._rebuild()

    def ready(self) -> bool:
        return bool(self.usable_prefill()) and bool(self.usable_decode())

    def back_off(self, worker: Worker) -> None:
        """``worker`` answered it is full: avoid it for ``capacity_backoff_s`` while another
        candidate exists. Not a fault: it stays healthy."""
        if self._backoff_s <= 0:
            return
        now = time.monotonic()
        if worker.full_until <= now:
            logger.info(
                "%s worker %s is full; avoiding it for %gs",
                worker.role.value,
                worker.public_url,
                self._backoff_s,
            )
        worker.full_until = until = now + self._backoff_s
        self._backoff_until = max(self._backoff_until, until)

    def _candidates(self, usable: list[Worker], cap: int) -> list[Worker]:
        if cap and usable:
            below = [w for w in usable if w.host_inflight() < cap]
            if not below:
                role = usable[0].role.value
                raise WorkersBusy(
                    f"every {role} worker is at its limit of {cap} requests in flight",
                    retry_after_s=self._retry_after_s,
                )
            usable = below
        now = time.monotonic()
        if now < self._backoff_until:
            open_now = [w for w in usable if w.full_until <= now]
            return open_now or usable
        return usable

    def _rebuild(self) -> None:
        workers = list(self._workers.values())
        self.prefill = [w for w in workers if w.role is Role.PREFILL]
        self.decode = [w for w in workers if w.role is Role.DECODE]
        # the names served; a worker naming none serves any ("": a name no worker serves)
        self.models = frozenset(name for w in workers for name in w.models)
        self.adapters = frozenset(name for w in workers for name in w.adapters)
        self.wildcards = any(not w.models for w in workers)
        self._pools = {
            name: tuple([w for w in role if not w.models or name in w.models] for role in both)
            for name in (*self.models, "")
            for both in [(self.prefill, self.decode)]
        }
