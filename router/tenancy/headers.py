"""The ``x-ratelimit-*`` headers OpenAI answers with, for one limit of one tenant.

OpenAI sends, per limit type (``requests``, ``tokens``)::

    x-ratelimit-limit-requests: 60
    x-ratelimit-remaining-requests: 59
    x-ratelimit-reset-requests: 1s        # until the window is full again, Go duration style

(``6m0s``, ``1m30.5s``, ``850ms``). The official ``openai`` client exposes them on the raw
response; what it reads itself, to wait before a retry, is ``retry-after-ms`` and
``retry-after`` (``router.errors.RateLimited`` sends both).
"""

from __future__ import annotations

import functools
import math

__all__ = ["duration", "duration_bytes", "ratelimit_headers", "ratelimit_names"]


def duration(seconds: float) -> str:
    """``seconds`` in the style OpenAI's reset headers use: ``850ms``, ``6s``, ``1m30.5s``,
    ``6m0s``, ``1h0m0s`` (never negative; below a second in whole milliseconds, rounded up)."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    millis = math.ceil(seconds * 1000)
    if millis < 60_000:  # the usual one: within a minute's window
        return f"{millis / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs = f"{millis / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def duration_bytes(seconds: float) -> bytes:
    """``duration(seconds)``, encoded for a header; the usual one (at least a second, under a
    minute: a reset within a window) formatted straight to bytes (0.27 against 0.36 µs)."""
    if seconds >= 1:
        millis = math.ceil(seconds * 1000)
        if millis < 60_000:
            whole, part = divmod(millis, 1000)
            if not part:
                return b"%ds" % whole
            if part % 10:
                return b"%d.%03ds" % (whole, part)
            if part % 100:
                return b"%d.%02ds" % (whole, part // 10)
            return b"%d.%ds" % (whole, part // 100)
    return duration(seconds).encode()


def ratelimit_headers(
    limit_type: str, limit: int, remaining: int, reset_s: float
) -> tuple[tuple[bytes, bytes], ...]:
    """The three headers of one limit (``limit_type``: ``requests`` or ``tokens``)."""
    limit_name, remaining_name, reset_name = ratelimit_names(limit_type)
    return (
        (limit_name, str(limit).encode()),
        (remaining_name, str(max(0, remaining)).encode()),
        (reset_name, duration_bytes(reset_s)),
    )


@functools.cache
def ratelimit_names(limit_type: str) -> tuple[bytes, bytes, bytes]:
    """The names of one limit's headers: limit, remaining, reset."""
    return (
        f"x-ratelimit-limit-{limit_type}".encode(),
        f"x-ratelimit-remaining-{limit_type}".encode(),
        f"x-ratelimit-reset-{limit_type}".encode(),
    )
