"""The async-context-manager plumbing shared by every resource-owning class of ``transfer/``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

__all__ = ["AsyncClosing", "cancel_and_wait"]


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel every task (None entries skipped), then wait until each has ended."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class AsyncClosing:
    """``async with obj:`` enters as ``obj`` (override ``__aenter__`` to open something) and
    exits through ``aclose()``, which subclasses implement and keep idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        raise NotImplementedError
