"""Awaiting work that a cancellation must not cut short: ``settled(work, stop)``.

A transfer call that is cancelled half way leaves its pages in an unknown state: a decode's
receive does not learn whether the prefill's writes into them are over, and a prefill's engine
write may still be reading its source pages. So when the caller is cancelled (its client went
away), ``stop()`` asks the work to end early (fail the room) and the caller waits for it to end
before ``CancelledError`` goes on: the work ends as it would have without the cancellation, and
the caller frees its pages only then. (The room's final status does not depend on it: the
sender pushes it from a task of its own, ``transfer.decode_link.DecodeLink.report_awaited``.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

__all__ = ["settled"]

_T = TypeVar("_T")


async def settled(work: asyncio.Future[_T], stop: Callable[[], object]) -> _T:
    """``work``'s result; when the caller is cancelled, ``stop()`` and wait for ``work`` to end
    (it must end soon after ``stop``; further cancellations wait too) before re-raising."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        stop()
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({work})
        if not work.cancelled():
            work.exception()  # retrieved: the caller learns the outcome from the future
        raise
