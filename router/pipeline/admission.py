"""Admission control: at most N completion requests served at once, a bounded FIFO wait queue.

A request is admitted after its body was read and parsed, so no slot is held while a client
uploads and a malformed request never waits; the queue holds at most ``max_queued_requests``
parsed bodies. Beyond the queue a request gets 429 at once; one that waited
``queue_timeout_s`` gets 429 too; both carry ``Retry-After``. A client that disconnects while
queued leaves the queue at once. ``release`` hands the slot straight to the oldest waiter.

Every operation is O(1): the fast path (a free slot, nobody waiting) is a compare and an add.
State is owned by the router's event loop (no locks); the gate is built per app context.
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

__all__ = ["AdmissionGate"]


class AdmissionGate:
    """``await acquire(disconnected)`` before serving, ``release()`` once the response ended
    (on every path); ``inflight`` and ``queued`` are exported as gauges."""

    def __init__(self, settings: AdmissionSettings, metrics: RouterMetrics | None = None) -> None:
        self._limit = settings.max_concurrent_requests or sys.maxsize
        self._max_queued = settings.max_queued_requests
        self._timeout_s = settings.queue_timeout_s
        self._retry_after_s = settings.retry_after_s
        self.inflight = 0
        # insertion order is the queue order; a waiter that gives up removes itself in O(1)
        self._waiters: OrderedDict[asyncio.Future[None], None] = OrderedDict()
        if metrics is not None:
            metrics.requests_inflight.set_function(lambda: self.inflight)
            metrics.admission_queue_depth.set_function(lambda: self.queued)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, disconnected: asyncio.Future[Any]) -> None:
        """Take a slot, waiting in the queue if none is free. Raises Overloaded (429) when the
        queue is full or the wait timed out, ClientDisconnected when ``disconnected`` (the
        client's next ASGI message) completes first."""
        if self.inflight < self._limit and not self._waiters:
            self.inflight += 1
            return
        if len(self._waiters) >= self._max_queued:
            raise Overloaded(
                f"the router is at its limit of {self._limit} concurrent requests and "
                f"{self._max_queued} queued; retry later",
                reason="queue_full",
                retry_after_s=self._retry_after_s,
            )
        await self._wait(disconnected)

    def release(self) -> None:
        """Give the slot back: to the oldest waiter still waiting, else to the pool."""
        waiters = self._waiters
        while waiters:
            waiter, _ = waiters.popitem(last=False)
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: inflight is unchanged
                return
        self.inflight -= 1

    async def _wait(self, disconnected: asyncio.Future[Any]) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[waiter] = None

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
                self.release()  # handed a slot just as it gave up (cancelled): pass it on
            raise
        finally:
            timer.cancel()
            disconnected.remove_done_callback(on_gone)

    def _timed_out(self) -> Overloaded:
        return Overloaded(
            f"the request waited {self._timeout_s:g}s for one of the router's "
            f"{self._limit} concurrent request slots; retry later",
            reason="queue_timeout",
            retry_after_s=self._retry_after_s,
        )
