"""Coroutines run as tasks for the length of a block: cancelled and awaited when it ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

__all__ = ["running"]


@contextlib.asynccontextmanager
async def running(*coroutines: Coroutine[Any, Any, Any]) -> AsyncIterator[list[asyncio.Task[Any]]]:
    """Run ``coroutines`` as tasks on the running loop; at the end cancel them and wait until
    they are done (their exceptions swallowed: they were cancelled)."""
    tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
