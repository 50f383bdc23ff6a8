"""In-process store (``memory://``): a dict, per-key lease deadlines on an injectable clock, queues.

Semantics beyond ``RegistryStore``'s contract:
* A key's deadline is ``clock() + ttl`` at its last ``put``/``refresh``. Expired keys are invisible
  to every call at once (each call expires due keys first), and while any key has a lease a reaper
  task checks the clock every ``REAP_INTERVAL_S`` of real time, so watchers see an expiry's delete
  event within about 50 ms of the clock passing the deadline, even with no calls in between.
* A watch is registered when ``watch()`` is called (not when iteration starts): it sees every
  change after that call. Each watch has its own unbounded queue, fed synchronously in store order.
* Once ``close()`` has run, open watches end, new watches end at once, and every other call raises
  ``RegistryUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Literal

from registry.backends.base import WatchEvent
from registry.errors import RegistryUnavailable

__all__ = ["REAP_INTERVAL_S", "MemoryStore"]

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.05


@dataclass(frozen=True, slots=True)
class _Entry:
    value: bytes
    ttl: float | None = None
    deadline: float | None = None


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Subscription:
    """One open watch; held weakly by the store, so an abandoned watch never leaks its queue."""

    prefix: str
    queue: asyncio.Queue[WatchEvent | None] = field(default_factory=asyncio.Queue)


class MemoryStore:
    """A ``RegistryStore`` inside this process; not shared between instances or processes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._revision = 0
        self._subscriptions: weakref.WeakSet[_Subscription] = weakref.WeakSet()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False

    async def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        self._check_open()
        self._expire_due()
        if ttl is None:
            entry = _Entry(value)
        else:
            if ttl <= 0:
                raise ValueError(f"ttl must be positive, got {ttl!r}")
            entry = _Entry(value, ttl, self._clock() + ttl)
            self._ensure_reaper()
        self._entries[key] = entry
        self._publish("put", key, value)

    async def refresh(self, key: str) -> bool:
        self._check_open()
        self._expire_due()
        entry = self._entries.get(key)
        if entry is None or entry.ttl is None:
            return False
        self._entries[key] = _Entry(entry.value, entry.ttl, self._clock() + entry.ttl)
        return True

    async def get(self, key: str) -> bytes | None:
        self._check_open()
        self._expire_due()
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    async def list(self, prefix: str) -> dict[str, bytes]:
        self._check_open()
        self._expire_due()
        return {key: e.value for key, e in self._entries.items() if key.startswith(prefix)}

    async def delete(self, key: str) -> bool:
        self._check_open()
        self._expire_due()
        if self._entries.pop(key, None) is None:
            return False
        self._publish("delete", key, None)
        return True

    def watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        """Changes under ``prefix`` after this call; ends when the store closes."""
        subscription = _Subscription(prefix)
        if self._closed:
            subscription.queue.put_nowait(None)
        else:
            self._subscriptions.add(subscription)
        return self._iterate(subscription)

    async def close(self) -> None:
        self._closed = True
        for subscription in list(self._subscriptions):
            subscription.queue.put_nowait(None)
        self._subscriptions.clear()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper

    async def _iterate(self, subscription: _Subscription) -> AsyncGenerator[WatchEvent, None]:
        try:
            while (event := await subscription.queue.get()) is not None:
                yield event
        finally:
            self._subscriptions.discard(subscription)

    def _check_open(self) -> None:
        if self._closed:
            raise RegistryUnavailable("memory store is closed")

    def _publish(self, kind: Literal["put", "delete"], key: str, value: bytes | None) -> None:
        self._revision += 1
        event = WatchEvent(kind, key, value, self._revision)
        for subscription in self._subscriptions:
            if key.startswith(subscription.prefix):
                subscription.queue.put_nowait(event)

    def _expire_due(self) -> None:
        now = self._clock()
        due = [
            key
            for key, entry in self._entries.items()
            if entry.deadline is not None and entry.deadline <= now
        ]
        for key in due:
            del self._entries[key]
            logger.debug("memory store: key %s expired", key)
            self._publish("delete", key, None)

    def _has_leases(self) -> bool:
        return any(entry.deadline is not None for entry in self._entries.values())

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap(), name="memory-store-reaper"
            )

    async def _reap(self) -> None:
        """Expire keys on time while any key has a lease, then end (``put`` restarts it)."""
        while self._has_leases():
            await asyncio.sleep(REAP_INTERVAL_S)
            self._expire_due()
