"""The last minutes of traffic in fixed time buckets, for the status page.

Per bucket: requests, server errors (status >= 500, and 499 never), client errors (4xx) and a
coarse TTFT histogram (streams) from which p50 and p95 are read. Prometheus keeps the real
history; this is what the router itself can show without one. Bounded: ``window_s /
bucket_s`` buckets of fixed size.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RecentTraffic"]

# TTFT bins: upper bounds in seconds (a percentile reads as its bin's upper bound)
_TTFT_BOUNDS = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, float("inf"),
)  # fmt: skip
_CLIENT_GONE = 499


@dataclass(slots=True)
class _Bucket:
    index: int  # start time // bucket_s
    requests: int = 0
    errors: int = 0
    client_errors: int = 0
    ttft_bins: list[int] = field(default_factory=lambda: [0] * len(_TTFT_BOUNDS))
    ttft_count: int = 0

    def percentile(self, share: float) -> float | None:
        if not self.ttft_count:
            return None
        rank = share * self.ttft_count
        seen = 0
        for bound, count in zip(_TTFT_BOUNDS, self.ttft_bins, strict=True):
            seen += count
            if seen >= rank:
                return bound if bound != float("inf") else _TTFT_BOUNDS[-2]
        return _TTFT_BOUNDS[-2]


class RecentTraffic:
    """Request counts, errors and TTFT per ``bucket_s`` over the last ``window_s``."""

    def __init__(self, window_s: float = 600.0, bucket_s: float = 5.0) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[_Bucket] = deque(maxlen=max(int(window_s // bucket_s), 1))

    def record(self, status: int, ttft_s: float | None, now: float | None = None) -> None:
        """One finished request: its final status and, for a stream, its TTFT."""
        bucket = self._current(time.time() if now is None else now)
        bucket.requests += 1
        if status >= 500:
            bucket.errors += 1
        elif 400 <= status < _CLIENT_GONE:
            bucket.client_errors += 1
        if ttft_s is not None:
            bucket.ttft_bins[bisect.bisect_left(_TTFT_BOUNDS, ttft_s)] += 1
            bucket.ttft_count += 1

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """Buckets oldest first, empty ones included, up to the current one."""
        now = time.time() if now is None else now
        last = int(now // self.bucket_s)
        first = last - (self._buckets.maxlen or 1) + 1
        held = {b.index: b for b in self._buckets}
        buckets = []
        for index in range(first, last + 1):
            bucket = held.get(index) or _Bucket(index)
            buckets.append(
                {
                    "t": index * self.bucket_s,
                    "requests": bucket.requests,
                    "errors": bucket.errors,
                    "client_errors": bucket.client_errors,
                    "ttft_p50_s": bucket.percentile(0.5),
                    "ttft_p95_s": bucket.percentile(0.95),
                }
            )
        return {"bucket_s": self.bucket_s, "window_s": self.window_s, "buckets": buckets}

    def raw(self) -> list[list[Any]]:
        """The buckets held, as plain lists (``[index, requests, errors, client errors, TTFT
        bins]``), for ``merged`` in another process (``router --workers N``)."""
        return [
            [b.index, b.requests, b.errors, b.client_errors, b.ttft_bins] for b in self._buckets
        ]

    def merged(self, raws: Iterable[Any], now: float | None = None) -> dict[str, Any]:
        """``snapshot`` of the sum of several processes' windows (each one's ``raw``, this
        process's included): the host's traffic. A malformed bucket is left out."""
        combined = RecentTraffic(self.window_s, self.bucket_s)
        buckets: dict[int, _Bucket] = {}
        for raw in raws:
            for entry in raw if isinstance(raw, list) else ():
                with contextlib.suppress(TypeError, ValueError):
                    _add(buckets, *entry)
        combined._buckets.extend(sorted(buckets.values(), key=lambda b: b.index))
        return combined.snapshot(now)

    def _current(self, now: float) -> _Bucket:
        index = int(now // self.bucket_s)
        buckets = self._buckets
        if buckets and buckets[-1].index == index:
            return buckets[-1]
        bucket = _Bucket(index)
        buckets.append(bucket)  # the deque drops the oldest
        return bucket


def _add(
    buckets: dict[int, _Bucket],
    index: int,
    requests: int,
    errors: int,
    client_errors: int,
    ttft_bins: list[int],
) -> None:
    """Add one process's bucket to the sum of ``buckets``."""
    if len(ttft_bins) != len(_TTFT_BOUNDS):
        raise ValueError("not a TTFT histogram of these bins")
    counts = [int(count) for count in ttft_bins]
    bucket = buckets.setdefault(int(index), _Bucket(int(index)))
    bucket.requests += int(requests)
    bucket.errors += int(errors)
    bucket.client_errors += int(client_errors)
    bucket.ttft_bins = [a + b for a, b in zip(bucket.ttft_bins, counts, strict=True)]
    bucket.ttft_count += sum(counts)
