"""Admission control: a budget of sequences served at once with a bounded wait queue ordered by
urgency and fair between tenants (``router.pipeline.admission_queue``), and a budget of
request-body memory.

A request takes one unit of ``max_concurrent_requests`` per sequence it asks for (``n`` x
prompts: what the engines generate and, with SGLang, the legs the router starts), at most the
whole budget, so that one big request still runs when it is alone. It is admitted after its
body was read and parsed, so no unit is held while a client uploads and a malformed request never
waits; the queue holds at most ``max_queued_requests`` parsed bodies. Beyond the queue a request
gets 429 at once, unless it is more urgent than the least urgent waiter: that one is shed (503)
and the arrival takes its place. One that waited ``queue_timeout_s`` gets 429, one whose own
deadline passed while it waited 503 at once; all carry ``Retry-After``. A client that
disconnects while queued leaves the queue at once. ``release`` hands the units to the most
urgent waiters (``WaitQueue.first``), in order: the head of the queue is not overtaken by
smaller requests behind it (head-of-line: a big request waits for enough units, and holds back
the others meanwhile, as it did in FIFO order).

``BodyMemory`` bounds the memory of the bodies being read, parsed, queued and served: each
request holds an estimate from its body's length (``BODY_MEMORY_FACTOR``) from its first byte
until it ends, and one that would pass the budget gets 429 at once.

The fast path (free units, nobody waiting) is a compare and two adds, with nothing allocated
(``try_acquire``: the caller works out the request's urgency only when it must wait); queueing
and waking are O(log n) (``WaitQueue``). State is owned by the router's event loop (no locks);
the gate is built per app context.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from router.errors import Overloaded, Shed
from router.load_board import ADMISSION, LoadBoard
from router.observability.metrics import RouterMetrics
from router.pipeline.admission_queue import (
    NORMAL,
    PRIORITY_BANDS,
    Urgency,
    Waiter,
    WaitQueue,
    await_turn,
)
from router.settings import AdmissionSettings

__all__ = ["BODY_MEMORY_FACTOR", "HOST_POLL_S", "AdmissionGate", "BodyMemory"]

# The memory one request's body is taken to hold, per byte of it: the bytes themselves, their
# parsed form (measured with msgspec: chat messages ~4x, token-id prompts ~6x; a large field the
# router does not read, such as a 28 MB logit_bias, stays raw: ~0x, see router.schemas) and the
# encoded copies sent to the two legs.
BODY_MEMORY_FACTOR = 8
HOST_POLL_S = 0.005  # --workers N: how often waiters look for units another process released
_UNITS, _BODY_BYTES = 0, 1  # the admission slot's fields on the host's load board


class BodyMemory:
    """The estimated bytes of the request bodies in the router: ``take`` as a body arrives
    (429 beyond the budget), ``give_back`` when its request ended."""

    __slots__ = ("_board", "_retry_after_s", "held", "limit", "parse_turn")

    def __init__(
        self, limit_bytes: int, retry_after_s: int, board: LoadBoard | None = None
    ) -> None:
        self.limit = limit_bytes or sys.maxsize
        self._retry_after_s = retry_after_s
        self._board = board  # router --workers N: the budget is the host's
        self.held = 0
        # large bodies are parsed one at a time (router.api.request_body.parse_in_turn)
        self.parse_turn = asyncio.Lock()

    def take(self, amount: int, own: int = 0) -> None:
        """Add ``amount`` to one request's share (``own``: what it holds already). Raises
        Overloaded (429) when that passes the budget while another request holds some of it: a
        request larger than the whole budget runs alone."""
        board = self._board
        host_held = self.held if board is None else board.total(ADMISSION, _BODY_BYTES)
        if host_held + amount > self.limit and host_held > own:
            raise Overloaded(
                f"the router holds the bodies of other requests up to its "
                f"{self.limit}-byte body memory budget (--max-body-memory; this request needs "
                f"about {own + amount} bytes, {BODY_MEMORY_FACTOR}x its body); retry later",
                reason="body_memory",
                retry_after_s=self._retry_after_s,
            )
        self.held += amount
        if board is not None:
            board.add(ADMISSION, _BODY_BYTES, amount)

    def give_back(self, amount: int) -> None:
        self.held -= amount
        if self._board is not None:
            self._board.add(ADMISSION, _BODY_BYTES, -amount)


class AdmissionGate:
    """``await acquire(disconnected, sequences)`` before serving, ``release(sequences)`` once
    the response ended (on every path); ``inflight`` (requests) and ``queued`` are exported as
    gauges. ``body_memory`` is the budget of request-body memory."""

    def __init__(
        self,
        settings: AdmissionSettings,
        metrics: RouterMetrics | None = None,
        *,
        board: LoadBoard | None = None,
        peers: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit = settings.max_concurrent_requests or sys.maxsize
        self._board = board  # router --workers N: the budget is the host's
        # replica peers: the units they use count too (a fleet-wide budget; their releases
        # are seen on their next snapshot, so waiters look again every HOST_POLL_S)
        self.peers = peers
        self._poll: asyncio.TimerHandle | None = None
        self._max_queued = settings.max_queued_requests
        self._timeout_s = settings.queue_timeout_s
        self._retry_after_s = settings.retry_after_s
        self.body_memory = BodyMemory(settings.max_body_memory_bytes, settings.retry_after_s, board)
        self.inflight = 0  # requests admitted
        self.units = 0  # their sequences (each at most the limit)
        self._queue = WaitQueue(settings.aging_s, clock)
        # the wait histogram's child of each priority band (None: metrics off)
        self._observe_wait: list[Callable[[float], None]] | None = None
        if metrics is not None and metrics.enabled:
            wait = metrics.admission_wait
            self._observe_wait = [wait.labels(label).observe for label in PRIORITY_BANDS]
        if metrics is not None:
            metrics.requests_inflight.set_function(lambda: self.inflight)
            metrics.admission_queue_depth.set_function(lambda: self.queued)
            by_band = self._queue.by_band
            for band, label in enumerate(PRIORITY_BANDS):
                gauge = metrics.admission_queued.labels(label)
                gauge.set_function(lambda band=band: by_band[band])  # type: ignore[misc]

    @property
    def queued(self) -> int:
        return self._queue.size

    @property
    def queued_by_band(self) -> dict[str, int]:
        """Queued requests per priority band (``PRIORITY_BANDS``)."""
        return dict(zip(PRIORITY_BANDS, self._queue.by_band, strict=True))

    def queued_by_tenant(self) -> dict[str, int]:
        """Queued requests per tenant (``""``: those without one)."""
        return self._queue.waiting_by_tenant()

    def place(self, urgency: Urgency, sequences: int = 1) -> dict[str, Any]:
        """Where a request of ``urgency`` would go if it arrived now: admitted at once, or
        queued behind ``queue_position`` waiters (``WaitQueue.position``: an estimate)."""
        units = min(sequences, self._limit)
        at_once = self._used() + units <= self._limit and not self._queue.size
        position = 0 if at_once else self._queue.position(urgency, units)
        return {
            "admitted_at_once": at_once,
            "queue_position": position,
            "queued": self.queued,
            # full: it would take the least urgent waiter's place, or get 429 if none is less so
            "queue_full": not at_once and self.queued >= self._max_queued,
        }

    def try_acquire(self, sequences: int = 1) -> bool:
        """The fast path: take a unit per sequence when they are free and nobody waits."""
        units = min(sequences, self._limit)
        if self._used() + units <= self._limit and not self._queue.size:
            self._take(units)
            return True
        return False

    async def acquire(
        self, disconnected: asyncio.Future[Any], sequences: int = 1, urgency: Urgency = NORMAL
    ) -> None:
        """Take a unit per sequence (at most the whole budget), waiting in the queue if they
        are not free, in the order of ``urgency``. Raises Overloaded: 429 when the queue is
        full of requests at least as urgent or the wait timed out, 503 (Shed) when a more
        urgent request took its place or its deadline passed; ClientDisconnected when
        ``disconnected`` (the client's next ASGI message) completes first."""
        if not self.try_acquire(sequences):
            await self._wait(disconnected, min(sequences, self._limit), urgency)

    def enqueue(
        self, disconnected: asyncio.Future[Any], sequences: int, urgency: Urgency
    ) -> Coroutine[Any, Any, None]:
        """``acquire`` when ``try_acquire`` has just failed (nothing awaited since): the wait
        in the queue (to await), without trying the fast path again."""
        return self._wait(disconnected, min(sequences, self._limit), urgency)

    def release(self, sequences: int = 1) -> None:
        """Give the units back, then admit the most urgent waiters that fit, in order."""
        units = min(sequences, self._limit)
        self.units -= units
        self.inflight -= 1
        if self._board is not None:
            self._board.add(ADMISSION, _UNITS, -units)
        if self._queue.size:
            self._wake()

    def host_units(self) -> int:
        """Units in use on this host: this process's, or with ``--workers N`` every one's (what
        the replicas' sync publishes)."""
        return self.units if self._board is None else self._board.total(ADMISSION, _UNITS)

    def _used(self) -> int:
        """Units in use: the host's; with replica peers, theirs too."""
        used = self.units if self._board is None else self._board.total(ADMISSION, _UNITS)
        return used if self.peers is None else used + self.peers()

    def _take(self, units: int) -> None:
        self.units += units
        self.inflight += 1
        if self._board is not None:
            self._board.add(ADMISSION, _UNITS, units)

    def _poll_host(self) -> None:
        """With ``--workers N`` another process's release frees units too: look again while
        requests wait (every ``HOST_POLL_S``)."""
        self._poll = None
        self._wake()
        if self._queue.size:
            self._poll = asyncio.get_running_loop().call_later(HOST_POLL_S, self._poll_host)

    def _wake(self) -> None:
        queue = self._queue
        # no free unit: nobody fits (each waiter takes one at least), first() not asked
        while self._used() < self._limit and (waiter := queue.first()) is not None:
            if waiter.future.done():  # gave up; it removes itself too
                queue.remove(waiter)
                continue
            if self._used() + waiter.units > self._limit:
                return  # the head waits for more: nobody overtakes it
            waited = queue.admit(waiter)
            self._take(waiter.units)
            waiter.future.set_result(None)
            if self._observe_wait is not None:
                self._observe_wait[waiter.band](waited)

    async def _wait(self, disconnected: asyncio.Future[Any], units: int, urgency: Urgency) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._queue.waiter(loop.create_future(), units, urgency)
        limit_s, late = self._timeout_s, self._timed_out
        if urgency.deadline_s is not None and urgency.deadline_s < limit_s:
            limit_s, late = urgency.deadline_s, self._deadline_passed
            if limit_s <= 0:
                raise late()
        if self._queue.size >= self._max_queued:
            self._make_room(waiter)
        self._queue.push(waiter)
        future = waiter.future
        if (self._board is not None or self.peers is not None) and self._poll is None:
            self._poll = loop.call_later(HOST_POLL_S, self._poll_host)
        try:
            await await_turn(future, disconnected, limit_s, late)
        except BaseException:
            self._queue.remove(waiter)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(units)  # admitted just as it gave up (cancelled): pass them on
            else:
                self._wake()  # it may have been the head that others waited behind
            raise

    def _make_room(self, arriving: Waiter) -> None:
        """The queue is full: shed its least urgent waiter (503) when ``arriving`` is more
        urgent, else raise Overloaded (429) for the arrival."""
        victim = self._queue.least_urgent()
        if victim is None or arriving.cls >= victim.cls:
            raise Overloaded(
                f"the router is at its limit of {self._limit} concurrent sequences and "
                f"{self._max_queued} queued requests; retry later",
                reason="queue_full",
                retry_after_s=self._retry_after_s,
            )
        self._queue.remove(victim)
        if not victim.future.done():
            victim.future.set_exception(
                Shed(
                    "the request was shed from the router's full admission queue for a more "
                    "urgent request; retry later",
                    reason="shed",
                    retry_after_s=self._retry_after_s,
                )
            )

    def _timed_out(self) -> Overloaded:
        return Overloaded(
            f"the request waited {self._timeout_s:g}s for its share of the router's "
            f"{self._limit} concurrent sequences; retry later",
            reason="queue_timeout",
            retry_after_s=self._retry_after_s,
        )

    def _deadline_passed(self) -> Overloaded:
        return Shed(
            "the request's deadline passed while it waited for its share of the router's "
            f"{self._limit} concurrent sequences; retry later",
            reason="deadline",
            retry_after_s=self._retry_after_s,
        )
