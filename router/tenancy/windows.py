"""The per-minute windows behind the tenant limits: ``limits``' fixed-window strategy over the
storage a URL names.

Storage: ``memory://`` (``limits``' in-process ``MemoryStorage``, the default: one router
process) or ``redis://HOST:PORT[/DB]`` / ``rediss://`` (``limits``' ``RedisStorage`` through
redis-py, for router replicas, or ``router --workers N`` processes, that must share a limit).
Other schemes ``limits`` knows (``memcached://``, ``mongodb://``, ``redis+sentinel://``...) are
passed through to it. Each window is one integer counter per tenant and limit type (``INCRBY``
in a Lua script on Redis), so replicas sharing a Redis see one count: an admission is atomic
there, and together the replicas never admit past a limit. The consistency is Redis's own (one
primary; a replica of Redis may lag, a failover may lose the last writes).

Why fixed windows: it is the one strategy of ``limits`` whose count is a single counter that a
``hit`` with any ``cost`` moves, so a request's estimated tokens can be charged, the unused part
given back and an overrun added when its answer ends, all atomically on a shared storage. The
moving window keeps one entry per unit (a million for a million tokens a minute) and cannot give
back; the sliding-window counter refuses a hit without counting it, so an overrun that already
happened could not be booked. The price: a tenant can spend up to twice a limit across the
boundary of two windows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, Storage
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import StorageError
from limits.limits import safe_string
from limits.storage import storage_from_string

from router.errors import RateLimited
from router.tenancy.headers import duration_bytes, ratelimit_headers, ratelimit_names

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["REFUND_MARGIN_S", "Charge", "Window", "Windows"]

logger = logging.getLogger(__name__)

# a refund this close to its window's end is dropped: it might land in the next window
REFUND_MARGIN_S = 1.0
_REDIS_SCHEMES = frozenset({"redis", "rediss"})


class PerMinute(RateLimitItemPerMinute):
    """A minute's window keyed by namespace, tenant and limit type only: ``limits`` puts the
    amount in the key too, so a reload that changed a limit would start every count at 0."""

    __slots__ = ()

    def key_for(self, *identifiers: bytes | str | int | float) -> str:
        return "/".join([self.namespace, *(safe_string(part) for part in identifiers)])


@dataclass(frozen=True, slots=True)
class Window:
    """``bucket``'s window of ``limit`` ``limit_type`` (``requests``, ``tokens``) a minute, made
    once and kept (``Windows.window``): its ``limits`` item and storage key, and what its
    ``x-ratelimit-*`` headers need that does not change (the names, the limit)."""

    limit_type: str
    bucket: str
    limit: int
    item: PerMinute
    key: str
    expiry: int  # seconds
    limit_header: tuple[bytes, bytes]  # x-ratelimit-limit-*: it does not change
    remaining_name: bytes
    reset_name: bytes


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~0.5 us more
class Charge:
    """What one admission put on one window: ``cost`` units, in the window that ends at
    ``reset_at`` (``time.time()``), which had ``remaining`` units left then."""

    window: Window
    cost: int
    reset_at: float
    remaining: int

    def reset(self, now: float) -> bytes:
        """The ``x-ratelimit-reset-*`` value: how long until the window ends, from ``now``."""
        return duration_bytes(self.reset_at - now)

    def headers(self, reset: bytes) -> tuple[tuple[bytes, bytes], ...]:
        """The window's three headers, its reset being ``reset`` (``reset(now)``)."""
        window = self.window
        return (
            window.limit_header,
            (window.remaining_name, b"%d" % self.remaining),
            (window.reset_name, reset),
        )


class Windows:
    """The windows of every tenant in one storage; ``namespace`` prefixes its keys.

    With ``memory://`` a charge increments the storage's counter itself (``_incr``: one a
    limit, two when refused) and reads the window's end from the storage's own expiry for the
    key: the same counts and ends as ``limits``' fixed-window strategy, which the other storages
    go through (``hit``, then ``get_window_stats``) for its one atomic script a call on Redis."""

    def __init__(self, storage_url: str, *, namespace: str) -> None:
        self.namespace = namespace
        self._pool: redis.asyncio.ConnectionPool | None = None
        url = storage_url.removeprefix("async+")
        if urlsplit(url).scheme in _REDIS_SCHEMES:
            # imported for a Redis storage only: redis-py imports OpenTelemetry's SDK when it
            # is installed, which the router otherwise loads only with tracing on
            import redis.asyncio

            self._pool = redis.asyncio.ConnectionPool.from_url(url)
            options: dict[str, Any] = {"implementation": "redispy", "connection_pool": self._pool}
        else:
            options = {}
        self.storage = cast(
            Storage, storage_from_string("async+" + url, wrap_exceptions=True, **options)
        )
        self._memory = self.storage if isinstance(self.storage, MemoryStorage) else None
        # the storage is this process's memory: ``charge_local`` and ``adjust_local`` do
        # without awaiting (the request path saves its coroutines)
        self.local = self._memory is not None
        self._strategy = FixedWindowRateLimiter(self.storage)
        self._windows: dict[tuple[str, str, int], Window] = {}

    def window(self, limit_type: str, bucket: str, limit: int) -> Window:
        """``bucket``'s window of ``limit`` ``limit_type`` a minute (made on first use)."""
        window = self._windows.get((limit_type, bucket, limit))
        if window is None:
            item = PerMinute(limit, namespace=self.namespace)
            limit_name, remaining_name, reset_name = ratelimit_names(limit_type)
            window = Window(
                limit_type,
                bucket,
                limit,
                item,
                item.key_for(bucket, limit_type),
                item.get_expiry(),
                (limit_name, b"%d" % limit),
                remaining_name,
                reset_name,
            )
            self._windows[(limit_type, bucket, limit)] = window
        return window

    def forget(self) -> None:
        """Drop the windows made so far (new limits: those of the old ones may never come
        back); the counts stay in the storage, under the same keys."""
        self._windows.clear()

    async def charge(self, window: Window, cost: int) -> Charge | None:
        """Put ``cost`` (at least 1) on ``window``; raises RateLimited when it does not fit,
        and nothing stays charged then (a hit over the limit is given back at once: for that
        moment the window looks fuller than it is, to this tenant only). None when the storage
        failed: the limit is not enforced for this request (fail open, logged) rather than
        failing it."""
        if self._memory is not None:
            return self.charge_local(window, cost, time.time())
        cost = max(cost, 1)
        try:
            fits, remaining, reset_at = await self._hit(window, cost)
        except StorageError as exc:
            logger.warning(
                "tenant limits not enforced: the %s storage failed: %s", window.limit_type, exc
            )
            return None
        if not fits:
            raise _refusal(window, cost, reset_at, remaining)
        return Charge(window, cost, reset_at, remaining)

    def charge_local(self, window: Window, cost: int, now: float) -> Charge:
        """``charge`` on the memory storage (``local``), without awaiting (``now``:
        ``time.time()``): the same counts and refusals; it cannot fail."""
        memory = self._memory
        assert memory is not None, "charge_local needs the memory storage"
        cost = max(cost, 1)
        key = window.key
        count = _incr(memory, key, window.expiry, cost, now)
        # the window's end, as the storage's ``get_expiry`` answers it, without the call
        reset_at = memory.expirations[key]
        if count > window.limit:
            count = _incr(memory, key, window.expiry, -cost, now)
            raise _refusal(window, cost, reset_at, max(0, window.limit - count))
        return Charge(window, cost, reset_at, window.limit - count)

    async def adjust(self, charge: Charge, delta: int) -> None:
        """Add ``delta`` to what ``charge`` put on its window: an overrun (> 0) always counts,
        in the current window; a refund (< 0) only while the charged window lasts (not within
        ``REFUND_MARGIN_S`` of its end), and never more than was charged."""
        if self._memory is not None:
            self.adjust_local(charge, delta)
            return
        delta = _adjustment(charge, delta, time.time())
        if delta == 0:
            return
        window = charge.window
        try:
            await self.storage.incr(window.key, window.expiry, delta)
        except StorageError as exc:
            logger.warning(
                "tenant %s usage not corrected: the storage failed: %s", window.limit_type, exc
            )

    def adjust_local(self, charge: Charge, delta: int) -> None:
        """``adjust`` on the memory storage (``local``), without awaiting."""
        assert self._memory is not None, "adjust_local needs the memory storage"
        now = time.time()
        delta = _adjustment(charge, delta, now)
        if delta:
            _incr(self._memory, charge.window.key, charge.window.expiry, delta, now)

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
        elif self._memory is not None and self._memory.timer is not None:
            self._memory.timer.cancel()

    async def _hit(self, window: Window, cost: int) -> tuple[bool, int, float]:
        """``limits``' strategy (a shared storage): fits, remaining, the window's end."""
        item, bucket, limit_type = window.item, window.bucket, window.limit_type
        fits = await self._strategy.hit(item, bucket, limit_type, cost=cost)
        if not fits:
            await self.storage.incr(window.key, window.expiry, -cost)
        stats = await self._strategy.get_window_stats(item, bucket, limit_type)
        return fits, stats.remaining, stats.reset_time


def _refusal(window: Window, cost: int, reset_at: float, remaining: int) -> RateLimited:
    limit_type, limit = window.limit_type, window.limit
    wait_s = max(reset_at - time.time(), 0.001)
    if cost > limit:
        what = f"this request's {cost} {limit_type} exceed the limit of {limit} per minute"
    else:
        what = f"limit of {limit} {limit_type} per minute reached ({cost} requested)"
    return RateLimited(
        f"Rate limit reached: {what}. Please try again in {wait_s:.3g}s.",
        limit_type=limit_type,
        reason=f"tenant_{limit_type}",
        retry_after_s=wait_s,
        headers=ratelimit_headers(limit_type, limit, remaining, wait_s),
    )


def _adjustment(charge: Charge, delta: int, now: float) -> int:
    """What of ``delta`` ``adjust`` applies: a refund (< 0) only while the charged window lasts
    (not within ``REFUND_MARGIN_S`` of its end), and never more than was charged."""
    if delta < 0:
        if now >= charge.reset_at - REFUND_MARGIN_S:
            return 0
        return max(delta, -charge.cost)
    return delta


def _incr(memory: MemoryStorage, key: str, expiry: int, amount: int, now: float) -> int:
    """``limits``' ``MemoryStorage.incr`` done synchronously on its own counters and
    expirations: a window that ended starts again at 0 (as its ``get``), the first count of a
    window sets its end. The storage's coroutine costs ~8 us a call on a busy event loop: each
    call takes an ``asyncio.Lock`` (needless on one loop) and, as its sweep of expired keys has
    finished since the last call, starts a new task for the next sweep; this takes ~0.5 us.
    Nothing needs that sweep here: the keys are one per tenant of the keys file (and the
    default bucket) and limit type, and a window that ended is reset when it is next used."""
    counts, ends = memory.storage, memory.expirations
    if ends.get(key, 0) <= now:
        counts.pop(key, None)
        ends.pop(key, None)
    count = counts[key] + amount
    counts[key] = count
    if count == amount:
        ends[key] = now + expiry
    return count
