"""Interrupting a request's own task when a concurrent event decides its fate.

The decode leg runs in the request's task (it owns the client response); the prefill leg and the
client-disconnect watcher are futures beside it. ``Interrupt`` turns "the prefill failed" or "the
client left" into an exception raised where the decode leg is waiting, without an extra task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

__all__ = ["ClientDisconnected", "Interrupt", "failure_of", "reap"]


class ClientDisconnected(Exception):
    """The client closed its connection (while its body was read, or while it was served: both
    legs were then cancelled)."""


def failure_of(task: asyncio.Future[Any]) -> BaseException | None:
    """The exception a finished task raised, if any (None when it succeeded or was cancelled)."""
    return None if task.cancelled() else task.exception()


class Interrupt:
    """Cancels the current task on an event (prefill failure, client gone) and re-raises it.

    Cheaper than running the guarded call in a task of its own and ``asyncio.wait``-ing: no extra
    task per request. ``fire`` only acts while armed, so a late event after the guarded call
    returned is ignored (both run on the event loop thread, so the flag cannot race).
    """

    __slots__ = ("_armed", "_reason", "_task")

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._armed = 0
        self._reason: BaseException | None = None

    @contextlib.contextmanager
    def on_done(
        self,
        future: asyncio.Future[Any],
        reason_of: Callable[[asyncio.Future[Any]], BaseException | None],
    ) -> Iterator[None]:
        """While the block runs, ``future`` finishing with a reason interrupts the task."""

        def fire(done: asyncio.Future[Any]) -> None:
            reason = reason_of(done)
            if self._armed and reason is not None and self._reason is None:
                self._reason = reason
                self._task.cancel()

        self._armed += 1
        future.add_done_callback(fire)
        try:
            if future.done():
                fire(future)
            yield
        finally:
            self._armed -= 1
            future.remove_done_callback(fire)

    async def guard(self, call: Coroutine[Any, Any, Any]) -> Any:
        """Await ``call``; if interrupted, raise the reason instead of CancelledError."""
        try:
            return await call
        except asyncio.CancelledError:
            if self._reason is None or self._task.uncancel() > 0:
                raise  # a real cancellation (shutdown), not ours
            raise self._reason from None


async def reap(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` if needed and wait until it is gone, ignoring how it ended."""
    if not task.done():
        task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - its outcome was already handled or is moot
        if not task.cancelled():
            task.exception()
