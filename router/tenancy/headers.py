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

import math

__all__ = ["duration", "ratelimit_headers"]


def duration(seconds: float) -> str:
    """``seconds`` in the style OpenAI's reset headers use: ``850ms``, ``6s``, ``1m30.5s``,
    ``6m0s``, ``1h0m0s`` (never negative; below a second in whole milliseconds, rounded up)."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    millis = math.ceil(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs = f"{millis / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(
    limit_type: str, limit: int, remaining: int, reset_s: float
) -> tuple[tuple[bytes, bytes], ...]:
    """The three headers of one limit (``limit_type``: ``requests`` or ``tokens``)."""
    return (
        (f"x-ratelimit-limit-{limit_type}".encode(), str(limit).encode()),
        (f"x-ratelimit-remaining-{limit_type}".encode(), str(max(0, remaining)).encode()),
        (f"x-ratelimit-reset-{limit_type}".encode(), duration(reset_s).encode()),
    )
