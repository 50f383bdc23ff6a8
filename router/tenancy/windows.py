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

from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, Storage
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import StorageError
from limits.limits import safe_string
from limits.storage import storage_from_string

from router.errors import RateLimited
from router.tenancy.headers import ratelimit_headers

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["REFUND_MARGIN_S", "Charge", "Windows"]

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
class Charge:
    """What one admission put on one window: ``cost`` units of ``limit_type`` (``requests``,
    ``tokens``) for ``bucket``, in the window that ends at ``reset_at`` (``time.time()``)."""

    limit_type: str
    item: RateLimitItem
    bucket: str
    cost: int
    reset_at: float
    remaining: int

    def headers(self, now: float) -> tuple[tuple[bytes, bytes], ...]:
        return ratelimit_headers(
            self.limit_type, self.item.amount, self.remaining, self.reset_at - now
        )


class Windows:
    """The windows of every tenant in one storage; ``namespace`` prefixes its keys."""

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
        self._strategy = FixedWindowRateLimiter(self.storage)

    async def charge(self, limit_type: str, bucket: str, limit: int, cost: int) -> Charge | None:
        """Put ``cost`` (at least 1) on ``bucket``'s window of ``limit`` a minute; raises
        RateLimited when it does not fit, and nothing stays charged then (a hit over the limit
        is given back at once: for that moment the window looks fuller than it is, to this
        tenant only). None when the storage failed: the limit is not enforced for this request
        (fail open, logged) rather than failing it."""
        item = PerMinute(limit, namespace=self.namespace)
        cost = max(cost, 1)
        try:
            fits = await self._strategy.hit(item, bucket, limit_type, cost=cost)
            if not fits:
                await self.storage.incr(item.key_for(bucket, limit_type), item.get_expiry(), -cost)
            stats = await self._strategy.get_window_stats(item, bucket, limit_type)
        except StorageError as exc:
            logger.warning("tenant limits not enforced: the %s storage failed: %s", limit_type, exc)
            return None
        if not fits:
            raise self._refusal(limit_type, limit, cost, stats.reset_time, stats.remaining)
        return Charge(limit_type, item, bucket, cost, stats.reset_time, stats.remaining)

    async def adjust(self, charge: Charge, delta: int) -> None:
        """Add ``delta`` to what ``charge`` put on its window: an overrun (> 0) always counts,
        in the current window; a refund (< 0) only while the charged window lasts (not within
        ``REFUND_MARGIN_S`` of its end), and never more than was charged."""
        if delta < 0:
            if time.time() >= charge.reset_at - REFUND_MARGIN_S:
                return
            delta = max(delta, -charge.cost)
        if delta == 0:
            return
        key = charge.item.key_for(charge.bucket, charge.limit_type)
        try:
            await self.storage.incr(key, charge.item.get_expiry(), delta)
        except StorageError as exc:
            logger.warning(
                "tenant %s usage not corrected: the storage failed: %s", charge.limit_type, exc
            )

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
        elif isinstance(self.storage, MemoryStorage) and self.storage.timer is not None:
            self.storage.timer.cancel()

    def _refusal(
        self, limit_type: str, limit: int, cost: int, reset_at: float, remaining: int
    ) -> RateLimited:
        now = time.time()
        wait_s = max(reset_at - now, 0.001)
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
