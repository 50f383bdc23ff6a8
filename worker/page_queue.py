"""One rank's waiting line for KV pages: first come, first served, bounded in length and time.

vLLM's and SGLang's schedulers keep a request whose KV does not fit in the free pages waiting
until running requests give pages back; their FCFS policy stops at the first waiting request
that does not fit, so a later, smaller request never overtakes it (head-of-line blocking). The
simulated engine does the same: ``take(attempt)`` runs ``attempt`` (an allocation that raises
``PoolExhausted`` when it does not fit) at once when nobody is waiting, otherwise the request
joins the line; the request at its head tries again each time pages come back (``notify``, called
by the pool's ``PrefixCache.on_release`` and when a decode aux slot is returned), and whenever
the head leaves, the next one tries.

Bounds, with the answers SGLang gives (vLLM has neither bound; both engines queue without limit
by default): at most ``max_waiting`` requests in line (``--max-queued-requests``; beyond it 503
"The request queue is full.") and at most ``timeout_s`` in line (``--waiting-timeout``, SGLang's
``SGLANG_REQ_WAITING_TIMEOUT``; then 503 "Request waiting timeout reached."). A request that can
never fit (more pages than the pool has) is refused with 400 before it queues
(``worker.serving``). Nothing is preempted: see docs/simulated-engine.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from worker.prefix_cache import PoolExhausted
from worker.protocol import WorkerError

__all__ = ["DEFAULT_MAX_WAITING", "DEFAULT_WAITING_TIMEOUT_S", "PageQueue"]

_T = TypeVar("_T")

DEFAULT_MAX_WAITING = 4096  # per rank: effectively unbounded, as the engines' defaults are
DEFAULT_WAITING_TIMEOUT_S = 300.0  # SGLang's PD waiting timeout (SGLANG_DISAGGREGATION_...)

QUEUE_FULL = "The request queue is full."
WAITING_TIMEOUT = "Request waiting timeout reached."


class PageQueue:
    """The FCFS line of requests waiting for one rank's KV pages (module docstring)."""

    def __init__(
        self,
        max_waiting: int = DEFAULT_MAX_WAITING,
        timeout_s: float = DEFAULT_WAITING_TIMEOUT_S,
    ) -> None:
        if max_waiting < 0 or timeout_s <= 0:
            raise ValueError(
                f"max_waiting must be >= 0 and timeout_s > 0, got {max_waiting}, {timeout_s}"
            )
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._line: deque[asyncio.Event] = deque()
        self.rejected_full = 0  # requests refused because the line was full, since start
        self.timed_out = 0  # requests that waited ``timeout_s`` in vain, since start

    @property
    def waiting(self) -> int:
        """Requests in line now."""
        return len(self._line)

    def notify(self) -> None:
        """Pages (or an aux slot) came back: the request at the head of the line tries again."""
        if self._line:
            self._line[0].set()

    async def take(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()``'s result once it fits, in arrival order.

        Raises ``WorkerError`` 503 when the line is full or the wait exceeds ``timeout_s``.
        Cancelled while waiting, the request leaves the line (it holds nothing yet).
        """
        if not self._line:
            with contextlib.suppress(PoolExhausted):
                return attempt()
        if len(self._line) >= self.max_waiting:
            self.rejected_full += 1
            raise WorkerError(503, QUEUE_FULL)
        turn = asyncio.Event()
        self._line.append(turn)
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    await turn.wait()
                    try:
                        return attempt()
                    except PoolExhausted:
                        turn.clear()  # after: a failed attempt's own rollback notifies too
        except TimeoutError:
            self.timed_out += 1
            raise WorkerError(503, WAITING_TIMEOUT) from None
        finally:
            self._line.remove(turn)
            self.notify()  # the next in line (now the head) tries at once
