"""Poll a condition with a deadline: the tests' only way to wait for something to happen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["await_until", "wait_until"]

_POLL_S = 0.01


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, *, interval: float = _POLL_S
) -> None:
    """Poll ``predicate`` every ``interval`` s (10 ms; slower for costly checks such as a real
    engine's ``/metrics`` on shared cores) until it holds; fail the test naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def await_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """``wait_until`` for async tests: polls every 10 ms without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(_POLL_S)
