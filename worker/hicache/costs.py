"""The modelled costs of moving KV pages between cache tiers (``worker.hicache.controller``).

* ``Link``: a copy link of a fixed bandwidth as a busy-until clock. Every copy reserves its
  bytes' time after whatever the link already carries, so copies share it as they would share a
  PCIe link or a disk: a backup in flight delays the next load. Bandwidth 0 models nothing (a
  reservation takes no time).
* ``TokenBucket``: a bytes/s rate limit (0: none) with a burst of ``capacity`` bytes.
* ``sleep_until``: wait for a ``time.monotonic()`` deadline.

Only time is modelled here; the bytes themselves are copied by the caller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["Link", "TokenBucket", "sleep_until"]

Clock = Callable[[], float]


async def sleep_until(deadline: float) -> None:
    """Return at ``deadline`` (``time.monotonic()``), at once when it has passed."""
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


class Link:
    """A link of ``bandwidth`` bytes/s (0: free) as a busy-until clock."""

    def __init__(self, bandwidth: float, clock: Clock = time.monotonic) -> None:
        if bandwidth < 0:
            raise ValueError(f"bandwidth must be >= 0, got {bandwidth}")
        self.bandwidth = bandwidth
        self.busy_until = 0.0
        self._clock = clock

    def reserve(self, nbytes: int) -> tuple[float, float]:
        """The ``(start, end)`` of a copy of ``nbytes`` queued behind the link's earlier ones."""
        now = self._clock()
        if not self.bandwidth:
            return now, now
        start = max(now, self.busy_until)
        self.busy_until = start + nbytes / self.bandwidth
        return start, self.busy_until

    @property
    def idle(self) -> bool:
        """Whether every reserved copy has ended."""
        return self._clock() >= self.busy_until


class TokenBucket:
    """A bytes/s rate limit: ``await take(n)`` returns once ``n`` bytes may go (at once with
    ``rate`` 0). Starts full; takers queue in call order (the bucket goes negative)."""

    def __init__(self, rate: float, capacity: float, clock: Clock = time.monotonic) -> None:
        if rate < 0 or capacity <= 0:
            raise ValueError(f"rate must be >= 0 and capacity > 0, got {rate}, {capacity}")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._stamp = clock()

    async def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)
