"""Bookkeeping of ``MooncakeEngine`` writes: error codes, per-peer budgets and native batches.

``PeerBudget`` caps the entries in flight to one peer (the TCP transport wedges beyond its queue)
and serves waiters in arrival order. ``NativeBatch`` is one batch of entries submitted as one-entry
native batches: their ids, each entry's final status, and the ``EngineError`` code and message
that describe a batch that did not fully succeed. No native calls here but the status poll a
batch is swept with.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from transfer.page_layout import Entry

__all__ = [
    "CODE_FAILED",
    "CODE_TIMEOUT",
    "CODE_UNDRAINED",
    "NativeBatch",
    "PeerBudget",
    "StatusPoller",
]

CODE_FAILED = -1
CODE_TIMEOUT = -2
CODE_UNDRAINED = -3  # the write failed with entries still in flight: never reuse the pages

_DONE = 1


class StatusPoller(Protocol):
    """The native engine's non-blocking status poll of a one-entry batch."""

    def transfer_check_status(self, batch_id: int, /) -> int: ...


class PeerBudget:
    """Entries in flight to one peer, at most ``capacity``; waiters are served in arrival order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def in_flight(self) -> int:
        return self.capacity - self.free

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` (<= capacity) more entries may be in flight; cancellable."""
        if not self._waiters and n <= self.free:
            self.free -= n
            return
        item = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(item)
        try:
            await item[1]
        except asyncio.CancelledError:
            if item[1].done() and not item[1].cancelled():
                self.release(n)  # granted just as the wait was cancelled
            else:
                self._waiters.remove(item)
                self._grant()
            raise

    def release(self, n: int) -> None:
        self.free += n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            n, waiter = self._waiters.popleft()
            if not waiter.done():
                self.free -= n
                waiter.set_result(None)


@dataclass(eq=False)
class NativeBatch:
    """One batch of entries: its native batch ids and what became of each (0 while pending)."""

    entries: Sequence[Entry]
    ids: list[int] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)
    cursor: int = 0  # every entry before it has a final status
    failures: int = 0  # entries that ended with a status other than done
    submitted: bool = False  # ``ids`` holds every batch id the native engine handed out
    interrupted: bool = False  # the engine closed before the batch was accounted for

    @property
    def pending(self) -> int:
        return len(self.ids) - self.cursor

    @property
    def refused(self) -> bool:
        return len(self.ids) < len(self.entries)

    @property
    def ok(self) -> bool:
        return not (self.refused or self.failures or self.pending or self.interrupted)

    def sweep(self, native: StatusPoller) -> int:
        """Poll pending entries in order up to the first still pending one; return how many ended.

        ``transfer_check_status`` frees a batch once it reports done or failed, so an id is never
        polled again after its first non-zero answer.
        """
        start = self.cursor
        while self.cursor < len(self.ids):
            code = native.transfer_check_status(self.ids[self.cursor])
            if code == 0:
                break
            self.codes[self.cursor] = code
            self.failures += code != _DONE
            self.cursor += 1
        return self.cursor - start

    def describe(self, session: str, elapsed: float) -> str:
        """What became of the batch, for the ``EngineError`` message."""
        failed = [i for i, code in enumerate(self.codes[: self.cursor]) if code != _DONE]
        parts = [f"session {session}: {len(self.entries)} entries"]
        if self.refused and not self.interrupted:
            parts.append(f"submission refused at entry {len(self.ids)}")
        if failed:
            first = self.entries[failed[0]]
            parts.append(
                f"{len(failed)} failed (first: entry {failed[0]} src={first.src:#x} "
                f"dst={first.dst:#x} len={first.length}, status {self.codes[failed[0]]})"
            )
        if self.pending:
            parts.append(f"{self.pending} still in flight")
        if self.interrupted:
            parts.append("engine closed during the write")
        parts.append(f"after {elapsed:.3f} s")
        return ", ".join(parts)

    def code(self) -> int:
        """The ``EngineError`` code of a batch that did not fully succeed."""
        if self.pending or self.interrupted:
            return CODE_UNDRAINED
        if any(code == CODE_TIMEOUT for code in self.codes):
            return CODE_TIMEOUT
        return CODE_FAILED
