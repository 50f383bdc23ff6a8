"""A ZeroMQ socket read on the event loop (the sibling bus's and the replicas' sync's SUB).

A ZeroMQ socket's descriptor is edge-triggered: it wakes a reader when the socket's events may
have changed, not while messages wait. A reader that misses one wake-up (libzmq folds edges
together; ``zmq.asyncio`` has lost them under load, pyzmq#1203) leaves every queued message
unread until another arrives, and a bus that carries a breaker verdict once may never carry it
again. So the socket is drained on every wake-up *and* every ``interval_s``: a lost wake-up
delays a message by at most that long. A plain (blocking-mode) socket read with ``NOBLOCK``,
not ``zmq.asyncio``, whose ``send`` returns a future that hides a full buffer's ``Again``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

__all__ = ["DRAIN_BATCH", "read_forever"]

DRAIN_BATCH = 256  # messages taken per turn of the event loop (the rest right after other work)


async def read_forever(
    socket: zmq.Socket[bytes], take: Callable[[bytes], None], interval_s: float
) -> None:
    """Hand every message ``socket`` receives to ``take`` until cancelled."""
    loop = asyncio.get_running_loop()

    def drain() -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            take(frame)
        loop.call_soon(drain)

    descriptor = int(socket.getsockopt(zmq.FD))
    loop.add_reader(descriptor, drain)
    try:
        while True:
            drain()
            await asyncio.sleep(interval_s)
    finally:
        loop.remove_reader(descriptor)
