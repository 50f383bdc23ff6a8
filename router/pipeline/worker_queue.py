"""The second stage of admission: requests waiting for a worker below its in-flight cap.

Admission (``router.pipeline.admission``) orders requests until they hold a slot; after that,
without this stage, every admitted request goes to an engine at once and queues there, first
come first served (SGLang ignores priorities, vLLM only with ``--scheduling-policy priority``,
and neither knows the router's tenants). With ``--queue-at-worker-caps`` and an in-flight cap
(``--max-inflight-per-prefill`` / ``-decode`` / ``-worker``), a request whose every candidate of
its model's pool is at its cap (``WorkersBusy``) waits here instead of getting 429, and the
engines queue at most their caps: a flood that holds many slots no longer stands in front of an
interactive request or another tenant's at the prefills.

The order is the admission queue's (``WaitQueue``: most urgent class first, aged, weighted fair
between tenants, earliest deadline): one queue per model pool (a request only waits for the
workers of its own model). A leg that ends anywhere wakes the queues (``notify``, called from
``Worker.leg_ended``); a timer looks again every ``POLL_S`` while requests wait, for what no leg
end announces (another process's legs with ``router --workers N``, a worker added or healthy
again). A woken request is handed one free place (``handoffs``: places promised, not yet taken
by its route choice), so a wake never promises more places than are free, and a request arriving
while others wait or are being handed places queues behind them instead of taking the place.

Bounds: at most ``--max-queued-requests`` waiters per model (beyond, or 0: 429 ``worker_cap``
at once, as without this stage; ``--max-concurrent-requests`` bounds them too), each for at
most ``--queue-timeout`` (429) or its own deadline (503); a client that leaves leaves at once.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from router.errors import Overloaded, Shed, WorkersBusy
from router.observability.metrics import RouterMetrics
from router.pipeline.admission_queue import (
    NORMAL,
    PRIORITY_BANDS,
    Urgency,
    WaitQueue,
    await_turn,
)
from router.settings import AdmissionSettings
from router.workers import Worker, WorkerPool

__all__ = ["POLL_S", "STARTING_S", "WorkerQueue", "queue_at_caps"]

POLL_S = 0.05  # while requests wait: how often to look for room no leg end announced
STARTING_S = 1.0  # a chosen leg not started after this long counts no more (it never will)


def queue_at_caps(
    pool: WorkerPool[Any], settings: AdmissionSettings, metrics: RouterMetrics | None = None
) -> WorkerQueue | None:
    """The pool's worker queue when ``--queue-at-worker-caps`` is on (None: off), told of
    every leg's end at the pool's workers, present and future."""
    if not settings.queue_at_worker_caps:
        return None
    queue = WorkerQueue(pool, settings, metrics)
    pool.leg_ended = queue.notify
    for worker in pool.all():
        worker.leg_ended = queue.notify
    return queue


class _Pool(Protocol):
    """What the queue reads of the worker pool (``router.workers.WorkerPool``)."""

    def usable_prefill(self, model: str | None = None) -> list[Worker]: ...
    def usable_decode(self, model: str | None = None) -> list[Worker]: ...


class WorkerQueue:
    """``await wait(model, urgency, disconnected)`` when the route choice raised
    ``WorkersBusy`` (or ``waiting(model)``: others wait), then choose again, ``routed(model)``
    once the choice was made (or failed) and ``chosen(prefill, decode)`` for the route taken
    (``Pipeline._route_in_turn``); ``notify()`` when a leg ended."""

    def __init__(
        self,
        pool: _Pool,
        settings: AdmissionSettings,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._prefill_cap, self._decode_cap = settings.worker_caps()
        self.timeout_s = settings.queue_timeout_s
        self._max_queued = settings.max_queued_requests  # 0: no queue, 429 at once
        self._retry_after_s = settings.retry_after_s
        self._aging_s = settings.aging_s
        self._clock = clock
        self._queues: dict[str | None, WaitQueue] = {}
        self._handoffs: dict[str | None, int] = {}
        # legs chosen and not started yet (a prefill leg starts in its own task): per worker,
        # the dispatch count its chosen legs will have reached once started, and when chosen
        self._starting: dict[Worker, tuple[int, float]] = {}
        self._poll: asyncio.TimerHandle | None = None
        self._metrics = metrics
        if metrics is not None:
            metrics.worker_queue_depth.set_function(lambda: self.queued)
        # --worker-queue-reserve: the places held back from a tenant over its share, and each
        # tenant's requests in flight in this process (``holding``) with its weight
        self.reserve = settings.worker_queue_reserve
        self._held: dict[str, tuple[int, float]] = {}

    @property
    def queued(self) -> int:
        """Requests waiting for a worker, all models."""
        return sum(queue.size for queue in self._queues.values())

    def queued_by_band(self) -> dict[str, int]:
        """Requests waiting for a worker per priority band (``PRIORITY_BANDS``)."""
        counts = [0] * len(PRIORITY_BANDS)
        for queue in self._queues.values():
            for band, size in enumerate(queue.by_band):
                counts[band] += size
        return dict(zip(PRIORITY_BANDS, counts, strict=True))

    def waiting(self, model: str | None) -> bool:
        """Others wait for (or are being handed) a place in ``model``'s pool: an arriving
        request queues behind them instead of choosing a route."""
        queue = self._queues.get(model)
        return bool(queue is not None and queue.size) or bool(self._handoffs.get(model))

    def must_wait(self, model: str | None, urgency: Callable[[], Urgency] | None) -> bool:
        """An arriving request queues: others wait, or the places free are held back from its
        tenant (``--worker-queue-reserve``)."""
        if self.waiting(model):
            return True
        if not self.reserve:
            return False
        held = self.held_back(NORMAL if urgency is None else urgency())
        return bool(held) and self.room(model) <= held

    def hold(self, urgency: Urgency) -> None:
        """A request of ``urgency``'s tenant is in flight (until ``release``)."""
        count, _ = self._held.get(urgency.tenant, (0, urgency.weight))
        self._held[urgency.tenant] = (count + 1, urgency.weight)

    def release(self, urgency: Urgency) -> None:
        count, weight = self._held.get(urgency.tenant, (1, urgency.weight))
        if count > 1:
            self._held[urgency.tenant] = (count - 1, weight)
        else:
            self._held.pop(urgency.tenant, None)

    def held_back(self, urgency: Urgency) -> int:
        """Places ``urgency``'s tenant may not take now: the reserve while it has more than
        its weighted share of the requests in flight and another tenant has some (else 0)."""
        return self.reserve if urgency.tenant in self.over_share() else 0

    def over_share(self) -> frozenset[str]:
        """The tenants with more than their weighted share of the requests in flight, while
        another tenant has some (``--worker-queue-reserve``)."""
        held = self._held
        if not self.reserve or len(held) < 2:
            return frozenset()
        total = sum(count for count, _ in held.values())
        weights = sum(weight for _, weight in held.values())
        return frozenset(
            name for name, (count, weight) in held.items() if count > total * weight / weights
        )

    def place(self, model: str | None, urgency: Urgency) -> dict[str, Any]:
        """Where a request of ``urgency`` for ``model``'s pool would go now: routed at once
        (a place free, nobody waiting), or behind ``position`` of the ``waiting`` (an estimate:
        ``WaitQueue.position``, no later arrivals)."""
        queue = self._queues.get(model)
        waiting = 0 if queue is None else queue.size
        free = self.room(model) - self._handoffs.get(model, 0)
        held_back = self.held_back(urgency)
        at_once = free > held_back and not waiting
        position = 0 if at_once or queue is None else queue.position(urgency)
        return {
            "routed_at_once": at_once,
            "position": position,
            "waiting": waiting,
            "held_back": held_back,  # places held back from its tenant (--worker-queue-reserve)
        }

    def room(self, model: str | None) -> int:
        """Places free in ``model``'s pool now: legs that can start before a cap is reached
        (the smaller of the prefills' and the decodes'; ``sys.maxsize``: no cap)."""
        room = sys.maxsize
        if self._prefill_cap:
            room = self._free(self._pool.usable_prefill(model), self._prefill_cap)
        if self._decode_cap:
            room = min(room, self._free(self._pool.usable_decode(model), self._decode_cap))
        return room

    def chosen(self, *workers: Worker | None) -> None:
        """A route chose ``workers``: their legs count against the caps from now on, not only
        once their tasks started them (``Worker.load``), so no place is promised twice."""
        now = self._clock()
        for worker in workers:
            if worker is not None:
                dispatched = sum(worker.rank_dispatched)
                target, _ = self._starting.get(worker, (dispatched, now))
                self._starting[worker] = (max(target, dispatched) + 1, now)

    def _free(self, workers: list[Worker], cap: int) -> int:
        now = self._clock()
        free = 0
        for worker in workers:
            free += max(0, cap - worker.host_inflight() - self._not_started(worker, now))
        return free

    def _not_started(self, worker: Worker, now: float) -> int:
        entry = self._starting.get(worker)
        if entry is None:
            return 0
        target, at = entry
        left = target - sum(worker.rank_dispatched)
        if left <= 0 or now - at > STARTING_S:
            del self._starting[worker]
            return 0
        return left

    def notify(self) -> None:
        """A leg ended (or room may have appeared): hand places to the waiters that fit."""
        for model, queue in self._queues.items():
            if queue.size:
                self._wake(model, queue)

    def routed(self, model: str | None) -> None:
        """A woken request made its route choice (or gave up): its place is taken or free."""
        left = self._handoffs.get(model, 0) - 1
        if left > 0:
            self._handoffs[model] = left
        else:
            self._handoffs.pop(model, None)

    async def wait(
        self,
        model: str | None,
        urgency: Urgency,
        disconnected: asyncio.Future[Any],
        limit_s: float | None = None,
    ) -> None:
        """Wait for a place in ``model``'s pool, in the order of ``urgency``; on return the
        caller holds a handoff (``routed`` gives it back). Raises WorkersBusy (429) when the
        queue is full or after ``limit_s`` (default ``--queue-timeout``), Shed (503) when the
        request's deadline passed first, ClientDisconnected when the client left."""
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = WaitQueue(self._aging_s, self._clock)
        if queue.size >= self._max_queued:
            raise self._full(model)
        limit_s = self.timeout_s if limit_s is None else limit_s
        late: Overloaded = self._timed_out(model)
        if urgency.deadline_s is not None and urgency.deadline_s < limit_s:
            limit_s, late = urgency.deadline_s, self._deadline_passed()
        if limit_s <= 0:
            raise late
        loop = asyncio.get_running_loop()
        waiter = queue.waiter(loop.create_future(), 1, urgency)
        queue.push(waiter)
        future = waiter.future
        self._wake(model, queue)  # room may be free already (only handed to others)
        if self._poll is None and not future.done():
            self._poll = loop.call_later(POLL_S, self._look_again)
        try:
            await await_turn(future, disconnected, limit_s, lambda: late)
        except BaseException:
            queue.remove(waiter)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.routed(model)  # handed a place just as it gave up: pass it on
            self._wake(model, queue)
            raise

    def _wake(self, model: str | None, queue: WaitQueue) -> None:
        """Hand the free places not yet promised to the most urgent waiters, in order."""
        promised = self._handoffs.get(model, 0)
        free = self.room(model) - promised
        while free > 0:
            # the last places free are held back from the tenants over their share
            over = self.over_share() if self.reserve and free <= self.reserve else ()
            waiter = queue.first(over)
            if waiter is None:
                break
            if waiter.future.done():  # gave up; it removes itself too
                queue.remove(waiter)
                continue
            waited = queue.admit(waiter)
            promised += 1
            free -= 1
            waiter.future.set_result(None)
            if self._metrics is not None:
                self._metrics.observe(
                    self._metrics.worker_queue_wait, waited, PRIORITY_BANDS[waiter.band]
                )
        if promised:
            self._handoffs[model] = promised

    def _look_again(self) -> None:
        self._poll = None
        self.notify()
        if any(queue.size for queue in self._queues.values()):
            self._poll = asyncio.get_running_loop().call_later(POLL_S, self._look_again)

    def _timed_out(self, model: str | None) -> WorkersBusy:
        return WorkersBusy(
            f"every candidate worker{_of(model)} stayed at its in-flight cap while the request "
            f"waited {self.timeout_s:g}s for one; retry later",
            retry_after_s=self._retry_after_s,
        )

    def _full(self, model: str | None) -> WorkersBusy:
        return WorkersBusy(
            f"every candidate worker{_of(model)} is at its in-flight cap and "
            f"{self._max_queued} requests wait for one already; retry later",
            retry_after_s=self._retry_after_s,
        )

    def _deadline_passed(self) -> Shed:
        return Shed(
            "the request's deadline passed while it waited for a worker below its in-flight "
            "cap; retry later",
            reason="deadline",
            retry_after_s=self._retry_after_s,
        )


def _of(model: str | None) -> str:
    return "" if model is None else f" of model {model!r}"
