"""Messages between the processes of ``router --workers N`` (one host): each process publishes
on a ZeroMQ PUB socket at ``ipc://<run dir>/bus-<index>.ipc`` and subscribes to every
sibling's. A message is an envelope (sender, sequence number, send time) around one body, a
tagged ``msgspec`` struct; handlers are registered per body type.

Bounded, not best effort: a receiver counts what it missed from each sender (``gaps``: the
sender's send buffer was full, ``SEND_HWM``, or this process started after it); a publish never
blocks (a full buffer drops the message, ``dropped``). What travels here is short-lived advice
(predictions, breaker verdicts) whose loss costs what not sharing it costs; nothing is re-sent.
``lag_s`` is the last message's age on arrival.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from router.process_role import ProcessRole
from router.zmq_inbox import read_forever

__all__ = ["SiblingBus", "bus_endpoint"]

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages a slow sibling may lag behind before they are dropped (gaps)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a larger one is dropped by ZeroMQ
DRAIN_INTERVAL_S = 0.05  # the socket read this often too, wake-up or not (router.zmq_inbox)


class _Envelope(msgspec.Struct, array_like=True):
    sender: int
    seq: int
    sent: float  # time.time() at the sender
    body: msgspec.Raw


def bus_endpoint(role: ProcessRole, index: int) -> str:
    return "ipc://" + os.path.join(role.run_dir, f"bus-{index}.ipc")


class SiblingBus:
    """This process's end of the host's bus."""

    def __init__(self, role: ProcessRole, kinds: tuple[type[msgspec.Struct], ...]) -> None:
        self._role = role
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(bus_endpoint(role, role.index))
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for other in range(role.count):
            if other != role.index:
                self._sub.connect(bus_endpoint(role, other))
        self._encode = msgspec.msgpack.Encoder().encode
        self._envelope = msgspec.msgpack.Decoder(_Envelope).decode
        union: Any = functools.reduce(operator.or_, kinds)  # tagged structs
        self._body = msgspec.msgpack.Decoder(union).decode
        self._handlers: dict[type[msgspec.Struct], Callable[[Any], None]] = {}
        self._seq = 0
        self._last_seq: dict[int, int] = {}
        self.sent = self.dropped = self.received = self.gaps = 0
        self.lag_s: float | None = None

    def on(self, kind: type[msgspec.Struct], handler: Callable[[Any], None]) -> None:
        """Call ``handler(body)`` for each sibling message of type ``kind``."""
        self._handlers[kind] = handler

    def publish(self, body: msgspec.Struct) -> None:
        """Tell the siblings (never blocks: a full send buffer drops the message)."""
        self._seq += 1
        raw = msgspec.Raw(self._encode(body))
        envelope = _Envelope(self._role.index, self._seq, time.time(), raw)
        try:
            self._pub.send(self._encode(envelope), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    async def run(self) -> None:
        """Hand the siblings' messages to their handlers until cancelled."""
        await read_forever(self._sub, self._take, DRAIN_INTERVAL_S)

    def _take(self, frame: bytes) -> None:
        try:
            envelope = self._envelope(frame)
            body = self._body(envelope.body)
        except msgspec.DecodeError as exc:
            logger.warning("a sibling's message could not be read: %s", exc)
            return
        self.deliver(envelope.sender, envelope.seq, envelope.sent, body)

    def deliver(self, sender: int, seq: int, sent: float, body: msgspec.Struct) -> None:
        """Count and hand over one message (``run``'s; tests call it directly)."""
        last = self._last_seq.get(sender)
        if last is not None and seq > last + 1:
            self.gaps += seq - last - 1
        self._last_seq[sender] = seq
        self.received += 1
        self.lag_s = max(time.time() - sent, 0.0)
        handler = self._handlers.get(type(body))
        if handler is not None:
            handler(body)

    def stats(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "dropped": self.dropped,
            "received": self.received,
            "gaps": self.gaps,
            "lag_s": self.lag_s,
        }

    def close(self) -> None:
        self._pub.close()
        self._sub.close()
        self._context.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bus_endpoint(self._role, self._role.index).removeprefix("ipc://"))
