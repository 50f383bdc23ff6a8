"""Consumer side of the KV event feed: a SUB stream with gap recovery through replay.

The seq bookkeeping (what is due, duplicates, restarts, losses) is ``sequence.SeqTracker``, the
replay requests ``replay.ReplayClient``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Self, cast

import zmq
import zmq.asyncio

from transfer.closing import AsyncClosing

from . import codec
from .errors import KVEventDecodeError, ReplayTimeout
from .models import EventBatch
from .replay import ReplayClient
from .sequence import SeqTracker, SubscriberStats

__all__ = ["KVEventSubscriber", "ReceivedBatch", "SubscriberStats"]

logger = logging.getLogger(__name__)

# how long a wait for the live stream trusts the socket's descriptor alone: a wake-up lost
# (libzmq folds edges together; pyzmq#1203) delays a batch by at most this long
_WAKE_CHECK_S = 0.5


def _readable(sock: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _LiveSocket:
    """The live stream's SUB socket, a plain (blocking-mode) one read with ``NOBLOCK`` when its
    descriptor wakes the event loop (``zmq.asyncio``'s poll and receive futures cost several
    times a batch's decoding). The descriptor is edge-triggered: it signals that the socket's
    events may have changed, and reading them re-arms it."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, topic: str, hwm: int) -> None:
        sock: zmq.Socket[bytes] = zmq.Socket(context, zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        sock.connect(endpoint)
        self._socket = sock
        self._loop = asyncio.get_running_loop()
        self._descriptor = int(sock.getsockopt(zmq.FD))
        self._waiter: asyncio.Future[None] | None = None
        self._loop.add_reader(self._descriptor, self._on_descriptor)

    def take(self) -> list[bytes] | None:
        """The next message's frames, None when none is there (the events read: re-armed)."""
        if not _readable(self._socket):
            return None
        try:
            return self._socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def wait(self, wait_s: float) -> None:
        """Return once the descriptor woke the loop with a message there, or after ``wait_s``.
        Called right after ``take`` found nothing, with no turn of the loop in between: a
        message that comes in later wakes the descriptor."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(wait_s, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.remove_reader(self._descriptor)
        self._socket.close(linger=0)

    def _on_descriptor(self) -> None:
        # reading the events re-arms the descriptor (a reader with no waiter would otherwise be
        # called again at once); a waiter is woken when a message is there
        waiter = self._waiter
        if _readable(self._socket) and waiter is not None:
            _wake(waiter)


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One decoded batch. ``topic`` is None when it came through the old replay framing."""

    seq: int
    topic: str | None
    batch: EventBatch
    replayed: bool


class KVEventSubscriber(AsyncClosing):
    """Reads one publisher's batches in seq order, replaying what the live stream missed.

    ``async with KVEventSubscriber(endpoint, replay_endpoint=...) as sub`` connects a SUB to
    ``endpoint`` subscribed to the ``topic`` prefix and, if given, a DEALER to
    ``replay_endpoint``. ``async for item in sub`` (or ``await sub.next(timeout)``) yields
    :class:`ReceivedBatch` es with strictly increasing seqs. When a live seq jumps past the
    next expected one, the missing batches are requested from replay and yielded first;
    live duplicates of replayed batches are dropped. With ``start_seq``, everything from that
    seq on is replayed when the first live message arrives (this also covers ZMQ's slow
    joiner), or at once with :meth:`catch_up`; without it, the first live message sets the
    starting point.

    A replay that has not ended within ``replay_timeout`` seconds, a malformed reply, a seq
    evicted from the publisher's buffer, or no replay endpoint at all makes the missing seqs
    lost: logged at WARNING and counted in :attr:`stats`; when ``strict``, the next
    :meth:`next` also raises :class:`EventGapError` once the live message that revealed the
    gap has been taken in (iteration may continue after it, with the batches around the gap).
    Payloads that do not decode are logged, counted and skipped. A seq going backwards means
    the publisher restarted: its new stream is followed (replayed from 0). One subscriber
    follows one publisher (one DP rank); use one per rank.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        start_seq: int | None = None,
        replay_timeout: float = 2.0,
        strict: bool = False,
        hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic
        self._replay_timeout = replay_timeout
        self._hwm = hwm
        self._context = context or zmq.asyncio.Context.instance()
        self._pending: deque[ReceivedBatch] = deque()
        self._sub: _LiveSocket | None = None
        self._replay: ReplayClient | None = None
        self.stats = SubscriberStats()
        self._seqs = SeqTracker(endpoint, self.stats, start_seq=start_seq, strict=strict)

    @property
    def expected_seq(self) -> int | None:
        """The seq the live stream should deliver next (None before the first message)."""
        return self._seqs.expected

    async def __aenter__(self) -> Self:
        self._sub = _LiveSocket(self._context, self._endpoint, self._topic, self._hwm)
        if self._replay_endpoint is not None:
            self._replay = ReplayClient(self._replay_endpoint, self._replay_timeout, self._socket)
        return self

    async def aclose(self) -> None:
        if self._sub is not None:
            self._sub.close()
        if self._replay is not None:
            self._replay.close()
        self._sub, self._replay = None, None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> ReceivedBatch:
        return await self.next()

    async def next(self, timeout: float | None = None) -> ReceivedBatch:
        """The next batch in seq order.

        ``timeout`` bounds the wait for live messages (TimeoutError when it passes); a
        replay started meanwhile is bounded by ``replay_timeout`` on top. Cancelling is safe:
        a message is taken off the socket only when it can be handled at once, so a timeout
        or a cancellation never takes one without returning it, and a batch being recovered
        is asked for again on the next gap.
        """
        sub = self._sub
        if sub is None:
            raise RuntimeError("subscriber is not open")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._pending:
            # A message is taken off the socket only here, and handled before anything can
            # cancel this task: a timeout or a cancellation never loses one.
            frames = sub.take()
            if frames is not None:
                await self._on_live(frames)
                continue
            wait = _WAKE_CHECK_S if deadline is None else deadline - loop.time()
            if wait <= 0.0:
                raise TimeoutError
            await sub.wait(min(wait, _WAKE_CHECK_S))
        return self._pending.popleft()

    async def catch_up(self) -> int:
        """Queue every batch the publisher still buffers from ``start_seq`` on, before any live
        message: a subscriber that joins a running engine learns what it published already (an
        idle engine sends nothing live that would reveal the gap). Live copies of the replayed
        batches are dropped on arrival; batches evicted from the replay buffer are counted
        lost. Returns how many batches were queued.

        Raises RuntimeError without a replay endpoint or ``start_seq``, ReplayTimeout or
        KVEventDecodeError when the replay fails.
        """
        seqs, start = self._seqs, self._seqs.expected
        if start is None or self._replay is None:
            raise RuntimeError("catch_up needs a replay endpoint and a start_seq")
        before = len(self._pending)
        for message in await self._fetch(start):
            expected = seqs.expected
            assert expected is not None
            if message.seq < expected:
                continue
            if message.seq > expected:
                seqs.lose(expected, message.seq - 1, "evicted from the replay buffer")
            self._accept(message, replayed=True)
        if seqs.expected is not None and seqs.expected > start:
            seqs.drop_copies(start - 1, seqs.expected - 1)
        return len(self._pending) - before

    async def replay(self, start_seq: int) -> list[ReceivedBatch]:
        """Every batch the publisher still buffers with seq >= ``start_seq``, in order.

        Leaves the live tracking alone. Raises RuntimeError without a replay endpoint,
        ReplayTimeout or KVEventDecodeError when the replay fails.
        """
        messages = await self._fetch(start_seq)
        decoded = (self._decode(m, replayed=True) for m in messages)
        return [item for item in decoded if item is not None]

    async def _on_live(self, frames: list[bytes]) -> None:
        seqs = self._seqs
        seqs.gap = None
        try:
            message = codec.parse_live(frames)
        except KVEventDecodeError as exc:
            self.stats.malformed += 1
            logger.warning("skipping malformed KV event message from %s: %s", self._endpoint, exc)
            return
        if seqs.is_duplicate(message.seq):
            self.stats.duplicates += 1
            return
        due = seqs.place(message.seq)
        if message.seq > due:
            await self._recover(due, message.seq)
        expected = seqs.expected  # moved on if replay filled a gap
        assert expected is not None
        if message.seq >= expected:
            self._accept(message, replayed=False)
        if seqs.gap is not None:
            raise seqs.gap

    async def _recover(self, start: int, live_seq: int) -> None:
        """Fill ``start..live_seq-1`` from replay; whatever is not there is lost."""
        seqs = self._seqs
        if self._replay is None:
            seqs.lose(start, live_seq - 1, "no replay endpoint")
            return
        try:
            messages = await self._fetch(start)
        except (ReplayTimeout, KVEventDecodeError) as exc:
            seqs.lose(start, live_seq - 1, str(exc))
            return
        expected = start
        for message in messages:
            if message.seq < expected:
                continue
            if message.seq > expected:
                seqs.lose(expected, message.seq - 1, "evicted from the replay buffer")
            self._accept(message, replayed=True)
            expected = message.seq + 1
        if expected < live_seq:
            seqs.lose(expected, live_seq - 1, "not in the replay buffer")
        elif expected - 1 > live_seq:
            # Live copies of (live_seq, expected) may still be queued: drop them on arrival.
            seqs.drop_copies(live_seq, expected - 1)

    def _accept(self, message: codec.LiveMessage, *, replayed: bool) -> None:
        self._seqs.expected = message.seq + 1
        item = self._decode(message, replayed=replayed)
        if item is None:
            return
        self._pending.append(item)
        if replayed:
            self.stats.replayed += 1
        else:
            self.stats.received += 1

    def _decode(self, message: codec.LiveMessage, *, replayed: bool) -> ReceivedBatch | None:
        try:
            batch = codec.decode_batch(message.payload)
        except KVEventDecodeError as exc:
            self.stats.malformed += 1
            logger.warning(
                "skipping undecodable KV event batch %d from %s: %s",
                message.seq,
                self._endpoint,
                exc,
            )
            return None
        return ReceivedBatch(message.seq, message.topic, batch, replayed)

    async def _fetch(self, start_seq: int) -> list[codec.LiveMessage]:
        """The replay endpoint's batches from ``start_seq`` on (``ReplayClient.fetch``)."""
        if self._replay is None:
            raise RuntimeError("subscriber has no open replay endpoint")
        return await self._replay.fetch(start_seq)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        return sock
