"""KV cache events from the simulated engine, configured like the engines' ``--kv-events-config``.

``KVEventsConfig.from_json(text)`` reads vLLM's JSON keys (SGLang's are the same; unknown keys
such as SGLang's ``bind``/``format`` are ignored): ``enable_kv_cache_events``, ``publisher``
(``"zmq"`` or ``"null"``; unset: ``"zmq"`` when enabled), ``endpoint``, ``replay_endpoint``,
``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``.

DP rank ``r`` publishes on the endpoint's port + ``r`` and the replay port + ``r`` (port 0 is
left to the OS), as both engines do. A wildcard host (``*``, ``0.0.0.0``, ``::``) binds on the
worker's ``--host`` (so the default ``127.0.0.1`` keeps the feed local) unless that is itself a
wildcard. Unlike the engines, a named host is bound too, never connected to.

``RankEvents`` puts one rank's events on its publisher without blocking the caller: ``emit``
queues a list (one prefix-cache change: a request's newly cached pages, an eviction, a clear;
dropped with a warning beyond ``max_queue_size``) and a task publishes everything queued so far
as one ``EventBatch(ts, events, data_parallel_rank=r)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import msgspec
import zmq.asyncio

from transfer.closing import cancel_and_wait
from transfer.events import KVEvent, KVEventPublisher

__all__ = ["KVEventsConfig", "RankEvents", "open_rank_events", "rank_endpoint"]

logger = logging.getLogger(__name__)

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", ""})


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The ``--kv-events-config`` JSON (defaults as vLLM's ``KVEventsConfig``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; raises ``ValueError`` naming the bad field."""
        try:
            config = msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from exc
        if config.publisher not in (None, "zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown publisher {config.publisher!r}")
        if config.buffer_steps < 1 or config.hwm < 0 or config.max_queue_size < 1:
            raise ValueError("--kv-events-config: buffer_steps/max_queue_size >= 1, hwm >= 0")
        return config

    @property
    def enabled(self) -> bool:
        """Whether events are published (a ``zmq`` publisher with events enabled)."""
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def rank_endpoint(endpoint: str, rank: int, host: str) -> str:
    """``endpoint`` for DP rank ``rank``: tcp port + rank (0 stays 0), inproc ``_dp{rank}``."""
    if endpoint.startswith("inproc://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"KV event endpoint {endpoint!r}: expected tcp://HOST:PORT")
    name = parts.hostname or "*"
    if name in _WILDCARDS and host not in _WILDCARDS:
        name = host
    if name in _WILDCARDS:
        name = "*"
    port = parts.port + rank if parts.port else 0
    return f"tcp://[{name}]:{port}" if ":" in name else f"tcp://{name}:{port}"


class RankEvents:
    """One DP rank's event queue in front of its open ``KVEventPublisher``."""

    def __init__(self, publisher: KVEventPublisher, rank: int, max_queue_size: int) -> None:
        self.publisher = publisher
        self.rank = rank
        self._queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue(max_queue_size)
        self.dropped = 0

    def emit(self, events: list[KVEvent]) -> None:
        """Queue ``events`` for the next batch; never blocks (drops when the queue is full)."""
        try:
            self._queue.put_nowait(events)
        except asyncio.QueueFull:
            self.dropped += 1
            logger.warning(
                "rank %d: KV event queue full, %d events dropped", self.rank, len(events)
            )

    async def run(self) -> None:
        """Publish queued events until cancelled, one batch per wake-up."""
        while True:
            events = await self._queue.get()
            await self.flush(events)

    async def flush(self, events: list[KVEvent] | None = None) -> None:
        """Publish ``events`` plus everything queued, as one batch (nothing: no batch)."""
        batch = list(events or [])
        while not self._queue.empty():
            batch += self._queue.get_nowait()
        if batch:
            await self.publisher.publish(batch, dp_rank=self.rank)


@contextlib.asynccontextmanager
async def open_rank_events(
    config: KVEventsConfig, rank: int, host: str, context: zmq.asyncio.Context
) -> AsyncIterator[RankEvents]:
    """Bind rank ``rank``'s publisher and run its queue; on exit publish what is left, close."""
    replay = config.replay_endpoint
    async with KVEventPublisher(
        rank_endpoint(config.endpoint, rank, host),
        replay_endpoint=None if replay is None else rank_endpoint(replay, rank, host),
        topic=config.topic,
        buffer_steps=config.buffer_steps,
        hwm=config.hwm,
        context=context,
    ) as publisher:
        events = RankEvents(publisher, rank, config.max_queue_size)
        task = asyncio.create_task(events.run(), name=f"kv-events-rank{rank}")
        try:
            yield events
        finally:
            await cancel_and_wait([task])
            await events.flush()
