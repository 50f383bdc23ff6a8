"""Interrupting a request's own task when a concurrent event decides its fate.

The decode leg runs in the request's task (it owns the client response); the prefill leg and the
client-disconnect watcher are futures beside it. ``Interrupt`` turns "the prefill failed" or "the
client left" into an exception raised where the decode leg is waiting, without an extra task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
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

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        # with ``loop`` given, no ``get_running_loop()`` (a getpid system call in CPython 3.11)
        task = asyncio.current_task(loop)
        assert task is not None
        self._task = task
        self._armed = 0
        self._reason: BaseException | None = None

    def on_done(
        self,
        future: asyncio.Future[Any],
        reason_of: Callable[[asyncio.Future[Any]], BaseException | None],
    ) -> _Watch:
        """While the block runs, ``future`` finishing with a reason interrupts the task."""
        return _Watch(self, future, reason_of)

    def _fire(self, reason: BaseException | None) -> None:
        if self._armed and reason is not None and self._reason is None:
            self._reason = reason
            self._task.cancel()

    @staticmethod
    def together(*watches: _Watch) -> _Watches:
        """One block for several watches (entered in order, left in reverse)."""
        return _Watches(watches)

    def after(self, delay_s: float, reason: Callable[[], BaseException]) -> _Deadline:
        """While the block runs, ``delay_s`` passing interrupts the task with ``reason()`` (one
        timer: cheaper than ``asyncio.timeout``)."""
        return _Deadline(self, delay_s, reason)

    async def guard(self, call: Coroutine[Any, Any, Any]) -> Any:
        """Await ``call``; if interrupted, raise the reason instead of CancelledError."""
        try:
            return await call
        except asyncio.CancelledError as cancelled:
            raise self.reason(cancelled) from None

    def reason(self, cancelled: asyncio.CancelledError) -> BaseException:
        """What a guarded block raises for ``cancelled``: the interrupt's reason when it was
        ours, else the cancellation itself (a real one: shutdown, the caller). For blocks that
        await without ``guard``'s extra coroutine."""
        if self._reason is None or self._task.uncancel() > 0:
            return cancelled
        return self._reason


class _Watch:
    """``Interrupt.on_done``'s block (a plain class: no generator per watch)."""

    __slots__ = ("_future", "_interrupt", "_reason_of")

    def __init__(
        self,
        interrupt: Interrupt,
        future: asyncio.Future[Any],
        reason_of: Callable[[asyncio.Future[Any]], BaseException | None],
    ) -> None:
        self._interrupt = interrupt
        self._future = future
        self._reason_of = reason_of

    def _fire(self, done: asyncio.Future[Any]) -> None:
        self._interrupt._fire(self._reason_of(done))

    def __enter__(self) -> None:
        self._interrupt._armed += 1
        future = self._future
        future.add_done_callback(self._fire)
        if future.done():
            self._fire(future)

    def __exit__(self, *exc_info: object) -> None:
        self._interrupt._armed -= 1
        self._future.remove_done_callback(self._fire)


class _Watches:
    """``Interrupt.together``'s block."""

    __slots__ = ("_watches",)

    def __init__(self, watches: tuple[_Watch, ...]) -> None:
        self._watches = watches

    def __enter__(self) -> None:
        for watch in self._watches:
            watch.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        for watch in reversed(self._watches):
            watch.__exit__(*exc_info)


class _Deadline:
    """``Interrupt.after``'s block."""

    __slots__ = ("_delay_s", "_handle", "_interrupt", "_reason")

    def __init__(
        self, interrupt: Interrupt, delay_s: float, reason: Callable[[], BaseException]
    ) -> None:
        self._interrupt = interrupt
        self._delay_s = delay_s
        self._reason = reason
        self._handle: asyncio.TimerHandle | None = None

    def _fire(self) -> None:
        self._interrupt._fire(self._reason())

    def __enter__(self) -> None:
        self._interrupt._armed += 1
        loop = self._interrupt._task.get_loop()
        self._handle = loop.call_later(self._delay_s, self._fire)

    def __exit__(self, *exc_info: object) -> None:
        self._interrupt._armed -= 1
        if self._handle is not None:
            self._handle.cancel()


async def reap(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` if needed and wait until it is gone, ignoring how it ended."""
    if not task.done():
        task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - its outcome was already handled or is moot
        if not task.cancelled():
            task.exception()
