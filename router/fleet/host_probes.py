"""Health probes and engine load reads done once per host (``router --workers N``), not once
per process: an engine gets the probes and ``/metrics`` reads of one router, whatever N is.

Process 0 (the **leader**) probes and reads as a router on its own does, and publishes on the
host's bus (``router.sibling_bus``), every ``interval_s`` (the shorter of ``--health-interval``
and ``--load-interval``) once its first round of probes is done (a restarted leader knows
nothing before: it tells nothing), a ``ProbeRound``: each worker's health verdict, DP layout
(engine ids), learned models, engine load readings and the prefills' prefix-cache counters
(``router.fleet.engine_cache``). The other processes (**followers**) take each round into their
own workers: a worker the leader found down goes down (its requests are told,
``Worker.signal_loss``), one it found up comes back (not before the end of an ejection this
process made, ``router.fleet.outlier``), new engine ids are a restart, the load readings keep
their read time and freshness. A follower probes by itself once when it starts (it knows the
fleet before it takes connections, as before) and whenever no round came for
``LEADER_TIMEOUTS`` intervals (the leader is being restarted, the bus lost them): the host
then probes N times, as it did before, until the leader is heard again. A follower's view is at
most one interval plus the bus's lag behind the leader's; failed requests still reach every
process's breakers at once (``router.fleet.shared_breakers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from router.fleet.engine_cache import CacheReading, EngineCaches
from router.workers import EngineLoad, LoadReading, Role, Worker, WorkerPool

__all__ = ["LEADER_TIMEOUTS", "HostProbes", "ProbeRound"]

logger = logging.getLogger(__name__)

LEADER_TIMEOUTS = 3  # x interval_s without a round: a follower probes by itself


class RankReading(msgspec.Struct, array_like=True):
    running: float
    waiting: float
    kv_usage: float | None
    at: float  # time.monotonic() of the read (one clock for the host's processes)
    fresh_until: float
    dispatched: int  # the host's dispatch counter of the rank when the read began


class WorkerView(msgspec.Struct, array_like=True):
    worker_id: str
    healthy: bool
    dp_size: int
    engine_ids: list[str]
    models: list[str] | None  # learned from its /v1/models (None: declared, or none learned)
    adapters: list[str]  # those of the learned models that are LoRA adapters
    loads: list[RankReading | None]
    caches: list[
        CacheReading | None
    ]  # its prefix-cache counters per rank (router.fleet.engine_cache)


class ProbeRound(msgspec.Struct, array_like=True, tag="probe_round"):
    workers: list[WorkerView]


class _Channel(Protocol):
    def publish(self, body: msgspec.Struct) -> None: ...

    def on(self, kind: type[msgspec.Struct], handler: Callable[[Any], None]) -> None: ...


class HostProbes:
    """The leader's publishing loop, or a follower's watch (``run``); ``probe``: one round of
    this process's own probes and load reads (the follower's fallback)."""

    def __init__(
        self,
        pool: WorkerPool[Any],
        channel: _Channel,
        *,
        leader: bool,
        interval_s: float,
        probe: Callable[[], Awaitable[None]],
        on_back: Callable[[Worker], None] | None = None,
        probed: Callable[[], bool] = lambda: True,
        caches: EngineCaches | None = None,
    ) -> None:
        """``probed``: whether the leader's own probes made a round yet (before, its workers'
        verdicts are not known, not down: it publishes none)."""
        self._pool = pool
        self._channel = channel
        self.leader = leader
        self._interval_s = interval_s
        self._probe = probe
        self._on_back = on_back
        self._probed = probed
        self._caches = caches  # the engines' prefix-cache counters, read with their load
        self.heard_at = time.monotonic()  # the last round (a follower's start counts as one)
        self.rounds = 0  # rounds taken (a follower) or sent (the leader)
        self.fallbacks = 0  # a follower's own probe rounds
        self._changed = asyncio.Event()  # the leader's verdicts changed: publish now
        if not leader:
            channel.on(ProbeRound, self.take)

    def changed(self) -> None:
        """The leader: a worker went up or down (its own probes): the round goes out now, so
        that no sibling routes on the old verdict for up to an interval (at the first start,
        the siblings would answer 503 while the leader already serves)."""
        self._changed.set()

    async def run(self) -> None:
        """Until cancelled: the leader publishes a round every interval, and at once when a
        verdict changed; a follower probes once now, then again only while the leader is
        silent."""
        if self.leader:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self._interval_s)
                self._changed.clear()
                if self._probed():
                    self.publish()
        await self._probe()
        while True:
            await asyncio.sleep(self._interval_s)
            if time.monotonic() - self.heard_at > LEADER_TIMEOUTS * self._interval_s:
                self.fallbacks += 1
                await self._probe()

    def stats(self) -> dict[str, Any]:
        return {"leader": self.leader, "rounds": self.rounds, "fallbacks": self.fallbacks}

    def publish(self) -> None:
        self.rounds += 1
        caches = self._caches
        self._channel.publish(ProbeRound([_view(w, caches) for w in self._pool.all()]))

    def take(self, probe_round: ProbeRound) -> None:
        """A follower: the leader's round, into this process's workers."""
        self.heard_at = time.monotonic()
        self.rounds += 1
        for view in probe_round.workers:
            worker = self._pool.get(view.worker_id)
            if worker is not None:
                self._apply(worker, view)

    def _apply(self, worker: Worker, view: WorkerView) -> None:
        engine_ids = tuple(view.engine_ids)
        if view.dp_size != worker.dp_size or engine_ids != worker.engine_ids:
            worker.set_layout(view.dp_size, engine_ids)
        if view.models is not None and not worker.models_declared:
            names, adapters = frozenset(view.models), frozenset(view.adapters)
            if (names, adapters) != (worker.models, worker.adapters):
                self._pool.set_models(worker, names, declared=False, adapters=adapters)
        self._apply_health(worker, view.healthy)
        if len(view.loads) == worker.dp_size:
            worker.engine_load = [None if r is None else _reading(r) for r in view.loads]
        if self._caches is not None:
            for rank, cache in enumerate(view.caches):
                if cache is not None:
                    self._caches.take((worker.id, rank), cache)

    def _apply_health(self, worker: Worker, healthy: bool) -> None:
        if healthy and not worker.healthy:
            if worker.ejected and time.monotonic() < worker.ejected_until:
                return  # this process ejected it: out for its ejection time at least
            logger.info("%s worker %s is now healthy (host probes)", *_name(worker))
            worker.mark_up()
            if self._on_back is not None:
                self._on_back(worker)
        elif not healthy and worker.healthy:
            logger.warning("%s worker %s is now unhealthy (host probes)", *_name(worker))
            worker.mark_down("the host's probes failed")
            if worker.role is Role.PREFILL:
                worker.set_layout(worker.dp_size, ())


def _view(worker: Worker, caches: EngineCaches | None) -> WorkerView:
    loads = [
        None
        if r is None
        else RankReading(
            r.load.running, r.load.waiting, r.load.kv_usage, r.at, r.fresh_until, r.dispatched
        )
        for r in worker.engine_load
    ]
    models = None if worker.models_declared or not worker.models else sorted(worker.models)
    cached = [
        None if caches is None else caches.latest((worker.id, rank))
        for rank in range(worker.dp_size if worker.role is Role.PREFILL else 0)
    ]
    # a worker this process ejected is told as its probes see it: the ejection itself reaches
    # the siblings as one (router.fleet.shared_ejections), where each keeps its own budget
    healthy = worker.healthy or (worker.ejected and time.monotonic() < worker.ejected_until)
    adapters = sorted(worker.adapters) if models else []
    return WorkerView(
        worker.id, healthy, worker.dp_size, list(worker.engine_ids), models, adapters, loads, cached
    )


def _reading(r: RankReading) -> LoadReading:
    load = EngineLoad(r.running, r.waiting, r.kv_usage)
    return LoadReading(load, r.at, r.fresh_until, r.dispatched, r.running + r.waiting)


def _name(worker: Worker) -> tuple[str, str]:
    return worker.role.value, worker.public_url
