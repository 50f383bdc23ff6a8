"""Consumer side of the KV event feed: a SUB stream with gap recovery through replay."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Self, cast

import zmq
import zmq.asyncio

from transfer.closing import AsyncClosing

from . import codec
from .errors import EventGapError, KVEventDecodeError, ReplayTimeout
from .models import EventBatch

__all__ = ["KVEventSubscriber", "ReceivedBatch", "SubscriberStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One decoded batch. ``topic`` is None when it came through the old replay framing."""

    seq: int
    topic: str | None
    batch: EventBatch
    replayed: bool


@dataclass(slots=True)
class SubscriberStats:
    """Counters since the subscriber opened."""

    received: int = 0  # batches yielded from the live stream
    replayed: int = 0  # batches yielded from replay replies
    duplicates: int = 0  # live messages dropped because replay already yielded them
    lost: int = 0  # seqs neither received nor replayed
    malformed: int = 0  # messages or payloads skipped because they did not decode
    restarts: int = 0  # times the publisher's seq went backwards (it restarted)


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
        self._strict = strict
        self._hwm = hwm
        self._context = context or zmq.asyncio.Context.instance()
        self._expected = start_seq
        self._dup_window: tuple[int, int] | None = None  # (after, up to and including)
        self._pending: deque[ReceivedBatch] = deque()
        self._gap: EventGapError | None = None  # raised after the current message, if strict
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._replay_lock = asyncio.Lock()
        self.stats = SubscriberStats()

    @property
    def expected_seq(self) -> int | None:
        """The seq the live stream should deliver next (None before the first message)."""
        return self._expected

    async def __aenter__(self) -> Self:
        sub = self._socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, self._topic)
        self._sub = sub
        sub.connect(self._endpoint)
        if self._replay_endpoint is not None:
            self._dealer = self._open_dealer(self._replay_endpoint)
        return self

    async def aclose(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> ReceivedBatch:
        return await self.next()

    async def next(self, timeout: float | None = None) -> ReceivedBatch:
        """The next batch in seq order.

        ``timeout`` bounds the wait for live messages (TimeoutError when it passes); a
        replay started meanwhile is bounded by ``replay_timeout`` on top. Cancelling is safe:
        the wait is a poll, so a timeout or a cancellation never takes a message off the
        socket without returning it, and a batch being recovered is asked for again on the
        next gap.
        """
        sub = self._sub
        if sub is None:
            raise RuntimeError("subscriber is not open")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._pending:
            # Awaiting recv_multipart under a timeout would lose the message whose arrival
            # races the timeout (the future resolves, then the task is cancelled). So wait
            # with a poll, which takes nothing off the socket; once a message is there,
            # recv_multipart returns an already resolved future and awaiting it does not
            # suspend, so nothing can cancel the task in between.
            if not self._readable(sub):
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                if wait == 0.0 or not await sub.poll(
                    None if wait is None else math.ceil(wait * 1000)
                ):
                    raise TimeoutError
            frames = await sub.recv_multipart()
            await self._on_live(frames)
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
        start = self._expected
        if start is None or self._dealer is None:
            raise RuntimeError("catch_up needs a replay endpoint and a start_seq")
        before = len(self._pending)
        for message in await self._fetch(start):
            expected = self._expected
            assert expected is not None
            if message.seq < expected:
                continue
            if message.seq > expected:
                self._lose(expected, message.seq - 1, "evicted from the replay buffer")
            self._accept(message, replayed=True)
        if self._expected is not None and self._expected > start:
            self._dup_window = (start - 1, self._expected - 1)
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
        self._gap = None
        try:
            message = codec.parse_live(frames)
        except KVEventDecodeError as exc:
            self.stats.malformed += 1
            logger.warning("skipping malformed KV event message from %s: %s", self._endpoint, exc)
            return
        if self._is_duplicate(message.seq):
            self.stats.duplicates += 1
            return
        expected = self._expected
        if expected is not None and message.seq < expected:
            self.stats.restarts += 1
            logger.warning(
                "KV event seq went back from %d to %d at %s: publisher restarted",
                expected - 1,
                message.seq,
                self._endpoint,
            )
            expected = 0
        self._expected = message.seq if expected is None else expected
        if message.seq > self._expected:
            await self._recover(self._expected, message.seq)
        if message.seq >= self._expected:
            self._accept(message, replayed=False)
        if self._gap is not None:
            raise self._gap

    @staticmethod
    def _readable(sock: zmq.asyncio.Socket) -> bool:
        return bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)

    def _is_duplicate(self, seq: int) -> bool:
        window = self._dup_window
        if window is not None and window[0] < seq <= window[1]:
            return True
        self._dup_window = None
        return False

    async def _recover(self, start: int, live_seq: int) -> None:
        """Fill ``start..live_seq-1`` from replay; whatever is not there is lost."""
        if self._dealer is None:
            self._lose(start, live_seq - 1, "no replay endpoint")
            return
        try:
            messages = await self._fetch(start)
        except (ReplayTimeout, KVEventDecodeError) as exc:
            self._lose(start, live_seq - 1, str(exc))
            return
        expected = start
        for message in messages:
            if message.seq < expected:
                continue
            if message.seq > expected:
                self._lose(expected, message.seq - 1, "evicted from the replay buffer")
            self._accept(message, replayed=True)
            expected = message.seq + 1
        if expected < live_seq:
            self._lose(expected, live_seq - 1, "not in the replay buffer")
        elif expected - 1 > live_seq:
            # Live copies of (live_seq, expected) may still be queued: drop them on arrival.
            self._dup_window = (live_seq, expected - 1)

    def _lose(self, first: int, last: int, reason: str) -> None:
        """Give up on ``first..last``: log it, count it, and note it for strict mode."""
        self._expected = last + 1
        self.stats.lost += last - first + 1
        logger.warning(
            "lost KV event batches %d..%d from %s: %s", first, last, self._endpoint, reason
        )
        if not self._strict:
            return
        if self._gap is not None:
            first, reason = self._gap.first, f"{self._gap.reason}; {reason}"
        self._gap = EventGapError(first, last, reason)

    def _accept(self, message: codec.LiveMessage, *, replayed: bool) -> None:
        self._expected = message.seq + 1
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
        """Ask the replay endpoint from ``start_seq`` and collect replies up to the end marker.

        On any failure or cancellation the DEALER is replaced, so late replies to this
        request can never be mistaken for replies to the next one.
        """
        if self._replay_endpoint is None or self._dealer is None:
            raise RuntimeError("subscriber has no open replay endpoint")
        async with self._replay_lock:
            dealer, finished = self._dealer, False
            try:
                messages = await self._collect(dealer, start_seq)
                finished = True
                return messages
            except TimeoutError as exc:
                raise ReplayTimeout(self._replay_endpoint, start_seq, self._replay_timeout) from exc
            finally:
                if not finished:
                    dealer.close(linger=0)
                    self._dealer = self._open_dealer(self._replay_endpoint)

    async def _collect(self, dealer: zmq.asyncio.Socket, start_seq: int) -> list[codec.LiveMessage]:
        messages: list[codec.LiveMessage] = []
        async with asyncio.timeout(self._replay_timeout):
            await dealer.send_multipart(codec.replay_request_frames(start_seq))
            while True:
                reply = codec.parse_replay_reply(await dealer.recv_multipart())
                if isinstance(reply, codec.ReplayEnd):
                    return messages
                messages.append(reply)

    def _open_dealer(self, endpoint: str) -> zmq.asyncio.Socket:
        dealer = self._socket(zmq.DEALER)
        dealer.connect(endpoint)
        return dealer

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        return sock
