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
from typing import Any

from router.errors import Overloaded
from router.interrupt import ClientDisconnected
from router.observability.metrics import RouterMetrics
from router.settings import AdmissionSettings

__all__ = ["BODY_MEMORY_FACTOR", "AdmissionGate", "BodyMemory"]

# The memory one request's body is taken to hold, per byte of it: the bytes themselves, their
# parsed form (measured with msgspec: chat messages ~4x, token-id prompts ~6x; a large field the
# router does not read, such as a 28 MB logit_bias, stays raw: ~0x, see router.schemas) and the
# encoded copies sent to the two legs.
BODY_MEMORY_FACTOR = 8


class BodyMemory:
    """The estimated bytes of the request bodies in the router: ``take`` as a body arrives
    (429 beyond the budget), ``give_back`` when its request ended."""

    __slots__ = ("_retry_after_s", "held", "limit", "parse_turn")

    def __init__(self, limit_bytes: int, retry_after_s: int) -> None:
        self.limit = limit_bytes or sys.maxsize
        self._retry_after_s = retry_after_s
        self.held = 0
        # large bodies are parsed one at a time (router.api.request_body.parse_in_turn)
        self.parse_turn = asyncio.Lock()

    def take(self, amount: int, own: int = 0) -> None:
        """Add ``amount`` to one request's share (``own``: what it holds already). Raises
        Overloaded (429) when that passes the budget while another request holds some of it: a
        request larger than the whole budget runs alone."""
        held = self.held + amount
        if held > self.limit and self.held > own:
            raise Overloaded(
                f"the router holds the bodies of other requests up to its "
                f"{self.limit}-byte body memory budget (--max-body-memory; this request needs "
                f"about {own + amount} bytes, {BODY_MEMORY_FACTOR}x its body); retry later",
                reason="body_memory",
                retry_after_s=self._retry_after_s,
            )
        self.held = held

    def give_back(self, amount: int) -> None:
        self.held -= amount


class AdmissionGate:
    """``await acquire(disconnected, sequences)`` before serving, ``release(sequences)`` once
    the response ended (on every path); ``inflight`` (requests) and ``queued`` are exported as
    gauges. ``body_memory`` is the budget of request-body memory."""

    def __init__(self, settings: AdmissionSettings, metrics: RouterMetrics | None = None) -> None:
        self._limit = settings.max_concurrent_requests or sys.maxsize
        self._max_queued = settings.max_queued_requests
        self._timeout_s = settings.queue_timeout_s
        self._retry_after_s = settings.retry_after_s
        self.body_memory = BodyMemory(settings.max_body_memory_bytes, settings.retry_after_s)
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
        if self.units + units <= self._limit and not self._waiters:
            self.units += units
            self.inflight += 1
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
        self.units -= min(sequences, self._limit)
        self.inflight -= 1
        if self._waiters:
            self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter, units = next(iter(waiters.items()))
            if waiter.done():  # gave up; it removes itself too
                del waiters[waiter]
                continue
            if self.units + units > self._limit:
                return  # the head waits for more: nobody overtakes it
            del waiters[waiter]
            self.units += units
            self.inflight += 1
            waiter.set_result(None)

    async def _wait(self, disconnected: asyncio.Future[Any], units: int) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[waiter] = units

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
