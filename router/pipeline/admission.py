"""Admission control: a budget of sequences served at once with a bounded FIFO wait queue, and
a budget of request-body memory.

A request takes one unit of ``max_concurrent_requests`` per sequence it asks for (``n`` x
prompts: what the engines generate and, with SGLang, the legs the router starts), at most the
whole budget, so that one big request still runs when it is alone. It is admitted after its
body was read and parsed, so no unit is held while a client uploads and a malformed request never
waits; the queue holds at most ``max_queued_requests`` parsed bodies. Beyond the queue a request
gets 429 at once; one that waited ``queue_timeout_s`` gets 429 too; both carry ``Retry-After``. A
client that disconnects while queued leaves the queue at once. ``release`` hands the units to the
oldest waiters, in order: a big request at the head is not overtaken by smaller ones.

``BodyMemory`` bounds the memory of the bodies being read, parsed, queued and served: each
request holds an estimate from its body's length (``BODY_MEMORY_FACTOR``) from its first byte
until it ends, and one that would pass the budget gets 429 at once.

Every operation is O(1) but for waking waiters: the fast path (free units, nobody waiting) is a
compare and two adds. State is owned by the router's event loop (no locks); the gate is built
per app context.
"""

from __future__ import annotations

import asyncio
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from router.errors import Overloaded
from router.interrupt import ClientDisconnected
from router.load_board import ADMISSION, LoadBoard
from router.observability.metrics import RouterMetrics
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
        # insertion order is the queue order (a waiter -> its units); one that gives up removes
        # itself in O(1)
        self._waiters: OrderedDict[asyncio.Future[None], int] = OrderedDict()
        if metrics is not None:
            metrics.requests_inflight.set_function(lambda: self.inflight)
            metrics.admission_queue_depth.set_function(lambda: self.queued)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, disconnected: asyncio.Future[Any], sequences: int = 1) -> None:
        """Take a unit per sequence (at most the whole budget), waiting in the queue if they
        are not free. Raises Overloaded (429) when the queue is full or the wait timed out,
        ClientDisconnected when ``disconnected`` (the client's next ASGI message) completes
        first."""
        units = min(sequences, self._limit)
        if self._used() + units <= self._limit and not self._waiters:
            self._take(units)
            return
        if len(self._waiters) >= self._max_queued:
            raise Overloaded(
                f"the router is at its limit of {self._limit} concurrent sequences and "
                f"{self._max_queued} queued requests; retry later",
                reason="queue_full",
                retry_after_s=self._retry_after_s,
            )
        await self._wait(disconnected, units)

    def release(self, sequences: int = 1) -> None:
        """Give the units back, then admit the oldest waiters that fit, in order."""
        units = min(sequences, self._limit)
        self.units -= units
        self.inflight -= 1
        if self._board is not None:
            self._board.add(ADMISSION, _UNITS, -units)
        if self._waiters:
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
        if self._waiters:
            self._poll = asyncio.get_running_loop().call_later(HOST_POLL_S, self._poll_host)

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter, units = next(iter(waiters.items()))
            if waiter.done():  # gave up; it removes itself too
                del waiters[waiter]
                continue
            if self._used() + units > self._limit:
                return  # the head waits for more: nobody overtakes it
            del waiters[waiter]
            self._take(units)
            waiter.set_result(None)

    async def _wait(self, disconnected: asyncio.Future[Any], units: int) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[waiter] = units
        if (self._board is not None or self.peers is not None) and self._poll is None:
            self._poll = loop.call_later(HOST_POLL_S, self._poll_host)

        def fail(exc: BaseException) -> None:
            if not waiter.done():
                waiter.set_exception(exc)

        def on_gone(_: asyncio.Future[Any]) -> None:
            fail(ClientDisconnected())

        timer = loop.call_later(self._timeout_s, fail, self._timed_out())
        disconnected.add_done_callback(on_gone)
        if disconnected.done():
            fail(ClientDisconnected())
        try:
            await waiter
        except BaseException:
            self._waiters.pop(waiter, None)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(units)  # admitted just as it gave up (cancelled): pass them on
            else:
                self._wake()  # it may have been the head that others waited behind
            raise
        finally:
            timer.cancel()
            disconnected.remove_done_callback(on_gone)

    def _timed_out(self) -> Overloaded:
        return Overloaded(
            f"the request waited {self._timeout_s:g}s for its share of the router's "
            f"{self._limit} concurrent sequences; retry later",
            reason="queue_timeout",
            retry_after_s=self._retry_after_s,
        )
