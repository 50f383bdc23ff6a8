"""One attempt's timeline: when each leg answered, and the KV-arrival deadline between them.

After a prefill answered, the decode's first byte needs the KV cache. If the KV never comes (the
prefill died, or finished without keeping it), real engines wait 480-540 s before giving up, and
the client with them. ``LegClock`` starts a deadline when the prefill answers and ``expired``
resolves when the decode's first byte has not come by then. Only a streaming decode has a first
byte before its whole answer, so the deadline is armed for streams only (``watch_first_byte``).
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["LegClock"]


class LegClock:
    __slots__ = (
        "_handle",
        "_loop",
        "_timeout_s",
        "_watch",
        "expired",
        "first_byte",
        "prefill_done",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout_s: float, *, watch_first_byte: bool
    ) -> None:
        self._loop = loop
        self.prefill_done: float | None = None
        self.first_byte: float | None = None
        self._timeout_s = timeout_s
        self._watch = watch_first_byte
        self._handle: asyncio.TimerHandle | None = None
        # resolved with the deadline in seconds once it passed without a first byte; None: no
        # deadline (not a PD stream)
        self.expired: asyncio.Future[float] | None = (
            loop.create_future() if watch_first_byte else None
        )

    def prefill_answered(self) -> None:
        """The prefill answered: the KV is on its way; start the deadline."""
        self.prefill_done = time.monotonic()
        if self._watch and self.first_byte is None:
            self._handle = self._loop.call_later(self._timeout_s, self._expire, self._timeout_s)

    def decode_answered(self) -> None:
        """The decode's first byte arrived: the KV did too."""
        if self.first_byte is None:
            self.first_byte = time.monotonic()
        self.close()

    def kv_pending(self) -> bool:
        """Whether the decode may be waiting for a KV the prefill answered for (so losing the
        prefill loses it). Before the prefill answered, its own leg fails if it is lost.

        A stream knows by its first byte. A plain answer comes whole at the end, so it counts as
        waiting until the deadline has passed since the prefill answered (a transfer takes far
        less): a prefill lost later does not cancel a decode that is generating.
        """
        if self.first_byte is not None or self.prefill_done is None:
            return False
        return self._watch or time.monotonic() - self.prefill_done < self._timeout_s

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self, timeout_s: float) -> None:
        self._handle = None
        expired = self.expired
        if expired is not None and not expired.done():
            expired.set_result(timeout_s)
