"""Engine side of the KV event feed: a PUB live stream plus a ROUTER replay server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Self

import zmq
import zmq.asyncio

from transfer.closing import AsyncClosing, cancel_and_wait

from . import codec
from .models import EventBatch, KVEvent

__all__ = ["KVEventPublisher"]

logger = logging.getLogger(__name__)


class KVEventPublisher(AsyncClosing):
    """Publishes :class:`EventBatch` es as vLLM >= 0.26 / SGLang 0.5.23 do
    (docs/concepts/protocols.md 7.1).

    Use as ``async with KVEventPublisher(endpoint, replay_endpoint=...) as pub``. The PUB
    socket binds ``endpoint`` (``tcp://127.0.0.1:0`` picks a free port; read the result from
    :attr:`endpoint`). Each :meth:`publish` gets the next ``seq``, starting at 0, is sent as
    ``[topic, seq, payload]`` and kept in a replay buffer of the last ``buffer_steps`` batches.
    If ``replay_endpoint`` is given, a ROUTER there answers ``[identity, b"", start_seq]``
    with every buffered batch whose seq >= start_seq, in the new framing, then the end marker.

    Memory is bounded: no queue sits in front of the PUB socket, which holds at most ``hwm``
    messages per subscriber and drops beyond that (ZMQ PUB semantics: a slow subscriber loses
    messages and recovers them through replay); the buffer holds ``buffer_steps`` batches.

    ``context`` defaults to the process-wide ``zmq.asyncio.Context.instance()``; it is never
    terminated here. The sockets belong to this object and close on exit.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if buffer_steps < 1 or hwm < 0:
            raise ValueError("buffer_steps must be >= 1 and hwm >= 0")
        self._requested = (endpoint, replay_endpoint)
        self._topic = topic
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._context = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._buffer: deque[codec.LiveMessage] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None
        self._stack = contextlib.AsyncExitStack()

    @property
    def endpoint(self) -> str:
        """The bound live endpoint, with the OS-chosen port filled in."""
        if self._endpoint is None:
            raise RuntimeError("publisher is not open")
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay endpoint, or None when replay is off."""
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """The seq the next :meth:`publish` will use."""
        return self._next_seq

    async def __aenter__(self) -> Self:
        try:
            self._pub = self._bind(zmq.PUB, self._requested[0], self._hwm)
            self._endpoint = _last_endpoint(self._pub)
            if self._requested[1] is not None:
                await self._start_replay(self._requested[1])
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        self._pub = None
        self._endpoint = self._replay_endpoint = None
        await self._stack.aclose()

    async def publish(self, events: Sequence[KVEvent], dp_rank: int | None = None) -> int:
        """Send one batch live and keep it for replay; returns its seq.

        Never waits on subscribers: the PUB socket drops rather than blocks. Batches from
        concurrent callers get seqs in call order and go out in that order.
        """
        if self._pub is None:
            raise RuntimeError("publisher is not open")
        batch = EventBatch(ts=self._clock(), events=list(events), data_parallel_rank=dp_rank)
        message = codec.LiveMessage(self._topic, self._next_seq, codec.encode_batch(batch))
        self._next_seq += 1
        self._buffer.append(message)
        await self._send_live(self._pub, message)
        return message.seq

    async def _send_live(self, pub: zmq.asyncio.Socket, message: codec.LiveMessage) -> None:
        """Put one message on the live socket (the seam a lossy test double overrides)."""
        await pub.send_multipart(codec.live_frames(self._topic, message.seq, message.payload))

    def _bind(self, kind: int, endpoint: str, sndhwm: int) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        self._stack.callback(sock.close, linger=0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.bind(endpoint)
        return sock

    async def _start_replay(self, endpoint: str) -> None:
        # As vLLM 0.33: room for one whole buffer plus the end marker, twice over.
        router = self._bind(zmq.ROUTER, endpoint, 2 * (self._buffer_steps + 1))
        self._replay_endpoint = _last_endpoint(router)
        task = asyncio.create_task(self._serve_replay(router), name="kv-event-replay")
        task.add_done_callback(_log_crash)
        self._stack.push_async_callback(cancel_and_wait, [task])

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            request = codec.parse_replay_request(frames)
            if request is None:
                logger.warning(
                    "ignoring malformed KV event replay request: %d frames, sizes %s",
                    len(frames),
                    [len(f) for f in frames],
                )
                continue
            await self._answer(router, request)

    async def _answer(self, router: zmq.asyncio.Socket, request: codec.ReplayRequest) -> None:
        # Snapshot: publish() may append (and evict) while we await the sends.
        wanted = [m for m in self._buffer if m.seq >= request.start_seq]
        for message in wanted:
            await router.send_multipart(codec.replay_reply_frames(request.identity, message))
        await router.send_multipart(codec.replay_end_frames(request.identity))
        logger.debug("replayed %d KV event batches from seq %d", len(wanted), request.start_seq)


def _last_endpoint(sock: zmq.asyncio.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("KV event replay server stopped", exc_info=task.exception())
